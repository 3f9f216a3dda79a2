"""Stored responses belong to the API key that created them: another user key
gets 404 for every route of a response (as if it did not exist); the admin
sees all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server import REPO, Server, running, short_tempdir

pytestmark = pytest.mark.timeout(180)

ADMIN = "gva_0123abcd_" + "A" * 43


def _add_key(state: Path, name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "supervisor", "keys", "add", name, "--state-dir", str(state)],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    return out.stdout.strip()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_another_key_cannot_see_or_touch_a_response(tiny_model_path: Path) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    state = short_tempdir("gv")
    alice, bob = _add_key(state, "alice"), _add_key(state, "bob")
    with running(Server(models, state_dir=state, env={"GPUVISOR_ADMIN_TOKEN": ADMIN})) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as http:
        body = {"model": "tiny", "input": "hi", "max_output_tokens": 4}
        created = http.post("/v1/responses", json=body, headers=_bearer(alice))
        assert created.status_code == 200, created.text
        rid = created.json()["id"]
        queued = http.post("/v1/responses", json={**body, "background": True}, headers=_bearer(alice))
        assert queued.status_code == 200, queued.text
        bid = queued.json()["id"]
        for method, path in [("GET", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}/input_items"),
                             ("DELETE", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{bid}?stream=true"),
                             ("POST", f"/v1/responses/{bid}/cancel"), ("DELETE", f"/v1/responses/{bid}")]:
            r = http.request(method, path, headers=_bearer(bob))
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"]["code"] == "not_found"
        # Nor can bob continue alice's conversation.
        r = http.post("/v1/responses", json={**body, "previous_response_id": rid}, headers=_bearer(bob))
        assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found", r.text
        # Alice and the admin still see it; bob's attempts deleted nothing.
        assert http.get(f"/v1/responses/{rid}", headers=_bearer(alice)).status_code == 200
        assert http.get(f"/v1/responses/{rid}/input_items", headers=_bearer(alice)).status_code == 200
        assert http.get(f"/v1/responses/{bid}", headers=_bearer(alice)).status_code == 200
        assert http.get(f"/v1/responses/{rid}", headers=_bearer(ADMIN)).status_code == 200
        follow = http.post("/v1/responses", json={**body, "previous_response_id": rid}, headers=_bearer(alice))
        assert follow.status_code == 200, follow.text
        assert http.delete(f"/v1/responses/{rid}", headers=_bearer(ADMIN)).status_code == 200
        assert http.get(f"/v1/responses/{rid}", headers=_bearer(alice)).status_code == 404
