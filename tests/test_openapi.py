"""The OpenAPI document covers every route and is generated from the Structs
that validate requests (so it cannot drift from them)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from jobs.kinds import job_kinds
from supervisor.api import openapi
from supervisor.api.openai_types import ChatRequest
from supervisor.app import build_app
from supervisor.config import Config
from supervisor.responses.models import CreateRequest


def _registered(tmp_path: Path) -> set[tuple[str, str]]:
    # Built, never started: no cleanup context runs, no worker starts.
    cfg = Config(state_dir=str(tmp_path / "state"), models_dir=str(tmp_path / "models"))
    app = build_app(cfg)
    keys = set()
    for route in app.router.routes():
        info = route.resource.canonical if route.resource is not None else ""
        if route.method == "HEAD":
            continue  # aiohttp adds HEAD to every GET
        keys.add(openapi.route_key(route.method, info))
    return keys


def test_every_registered_route_is_documented(tmp_path: Path) -> None:
    registered = _registered(tmp_path)
    documented = openapi.operation_keys()
    missing = sorted(registered - documented)
    assert not missing, f"routes without an OpenAPI entry in supervisor/api/openapi.py ROUTES: {missing}"
    stale = sorted(documented - registered)
    assert not stale, f"documented routes the app does not register: {stale}"


def test_document_is_valid_openapi_3_1() -> None:
    schemathesis = pytest.importorskip("schemathesis")
    doc = openapi.build_document()
    assert doc["openapi"].startswith("3.1")
    schemathesis.openapi.from_dict(doc).validate()


def test_request_schemas_are_the_validating_structs() -> None:
    doc = openapi.build_document()
    components = doc["components"]["schemas"]
    for struct in (ChatRequest, CreateRequest, *(s.params for s in job_kinds().values())):
        _, own = msgspec.json.schema_components([struct], ref_template=openapi.REF)
        for name, schema in own.items():
            assert components[name] == schema, name
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat["schema"] == {"$ref": "#/components/schemas/ChatRequest"}
    submit = doc["paths"]["/api/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    kinds = {v["properties"]["kind"]["const"] for v in submit["oneOf"]}
    assert kinds == set(job_kinds())


def test_schema_and_struct_agree_on_samples() -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    doc = openapi.build_document()
    schema = {"$ref": "#/components/schemas/CreateRequest", "components": doc["components"]}
    validator = jsonschema_rs.validator_for(schema)
    samples: list[dict[str, Any]] = [
        {"model": "m", "input": "hi"},
        {"model": "m", "temperature": 3},
        {"model": "", "input": "hi"},
        {"model": "m", "tools": [{"type": "function", "name": "bad name!"}]},
        {"model": "m", "max_output_tokens": 0},
        {"input": "hi"},
    ]
    for sample in samples:
        try:
            msgspec.convert(sample, CreateRequest)
            struct_ok = True
        except msgspec.ValidationError:
            struct_ok = False
        assert validator.is_valid(sample) == struct_ok, sample


def test_served_at_openapi_json() -> None:
    async def fetch() -> dict[str, Any]:
        app = web.Application()
        openapi.add_routes(app)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get(openapi.OPENAPI_PATH)
            assert resp.status == 200
            assert resp.content_type == "application/json"
            body: dict[str, Any] = await resp.json()
            return body

    body = asyncio.run(fetch())
    assert "/v1/responses" in body["paths"]
    assert body["paths"]["/openapi.json"]["get"]["summary"]
