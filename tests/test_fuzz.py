"""Bad input against a live server: schemathesis over ``/openapi.json``, then
hand-written cases a schema-driven fuzzer will not find.

Every answer must be a success or an OpenAI-shaped error; a 5xx other than a
documented 503 shed (with Retry-After) fails, so does a parent that died or a
request that hangs.
"""

from __future__ import annotations

import json
import socket
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server import Server, short_tempdir

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

# Per operation and mode; 35 operations, so the default run stays near a minute.
MAX_EXAMPLES = 6
LONG_EXAMPLES = 150
REQUEST_TIMEOUT = 30.0


def content_type(resp: httpx.Response | Any) -> str:
    """Of an httpx response or a schemathesis one (lower-case names, list values)."""
    if isinstance(resp, httpx.Response):
        return str(resp.headers.get("Content-Type", ""))
    values = resp.headers.get("content-type") or [""]
    return str(values[0])


def header(resp: httpx.Response | Any, name: str) -> str | None:
    if isinstance(resp, httpx.Response):
        value = resp.headers.get(name)
        return None if value is None else str(value)
    values = resp.headers.get(name.lower())
    return str(values[0]) if values else None


def assert_openai_error(resp: httpx.Response | Any, what: str = "") -> dict[str, Any]:
    assert content_type(resp).startswith("application/json"), (what, resp.headers)
    body = resp.json()
    assert set(body) == {"error"}, (what, body)
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], (what, body)
    assert isinstance(err["type"], str), (what, body)
    assert err.get("param") is None or isinstance(err["param"], str), (what, body)
    assert err.get("code") is None or isinstance(err["code"], str), (what, body)
    return err  # type: ignore[no-any-return]


def assert_acceptable(resp: httpx.Response | Any, what: str) -> None:
    """No 5xx but a documented shed; every error on the API OpenAI-shaped."""
    status = resp.status_code
    if status >= 500:
        assert status == 503 and header(resp, "Retry-After"), (what, status, resp.text[:500])
    if status >= 400 and not content_type(resp).startswith("text/html"):
        assert_openai_error(resp, what)


def server_errors(srv: Server, limit: int = 6000) -> str:
    """The tracebacks the server logged (the access log left out)."""
    lines = [line for line in srv.log_text().splitlines() if " INFO " not in line]
    return "\n".join(lines)[-limit:]


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = Server(models, env={"GPUVISOR_MAX_CONCURRENT_JOBS": "1"}).start()
    try:
        yield srv
    finally:
        srv.cleanup()


def _steer(case: Any) -> None:
    """Half the bodies naming a model name the real one, so generation and
    its parameters are fuzzed too, not only the 404 path."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        if zlib.crc32(repr(sorted(body)).encode()) % 2 == 0:
            body["model"] = "tiny"


def _clean_up(case: Any, resp: Any, srv: Server) -> None:
    # A fuzzed sleep job may ask for a million steps: cancel what got queued.
    if case.method == "POST" and case.path == "/api/jobs" and resp.status_code in (200, 201):
        job_id = resp.json()["id"]
        r = httpx.post(f"{srv.base_url}/api/jobs/{job_id}/cancel", timeout=REQUEST_TIMEOUT)
        assert r.status_code in (200, 409), r.text


def _fuzz_operation(operation: Any, mode: Any, srv: Server, max_examples: int) -> None:
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        _steer(case)
        resp = case.call(base_url=srv.base_url, timeout=REQUEST_TIMEOUT)
        what = f"{case.method} {case.formatted_path} {str(case.body)[:300]}"
        assert srv.proc is not None and srv.proc.poll() is None, "the parent died"
        assert_acceptable(resp, what)
        case.validate_response(resp, checks=[response_schema_conformance, status_code_conformance,
                                             content_type_conformance])
        _clean_up(case, resp, srv)

    run()


def run_schemathesis(srv: Server, max_examples: int) -> None:
    # The schema is loaded from the live server: what is fuzzed is what it
    # serves. (A loop, not schemathesis.pytest.from_fixture: that one needs pytest < 9.)
    schema = schemathesis.openapi.from_url(srv.base_url + "/openapi.json")
    failures: list[str] = []
    count = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            count += 1
            try:
                _fuzz_operation(operation, mode, srv, max_examples)
            except Unsatisfiable:
                continue  # nothing to break: no body and no parameters
            except (Exception, BaseExceptionGroup) as exc:  # collected: one report for all operations
                failures.append(f"{operation.method.upper()} {operation.path} ({mode.value}): {exc}")
    assert count >= 60
    assert not failures, "\n\n".join(failures) + "\n\nserver errors:\n" + server_errors(srv)
    _alive(srv)


def test_schemathesis(fuzz_server: Server) -> None:
    run_schemathesis(fuzz_server, MAX_EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_schemathesis_long(fuzz_server: Server, request: pytest.FixtureRequest) -> None:
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the long variant runs with -m slow")
    run_schemathesis(fuzz_server, LONG_EXAMPLES)


# ---------------------------------------------------------------- hand-written


def _chat(srv: Server, timeout: float = REQUEST_TIMEOUT, **extra: Any) -> httpx.Response:
    body = {"model": srv.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=timeout)


def _alive(srv: Server) -> None:
    assert srv.proc is not None and srv.proc.poll() is None, "the parent died"
    assert _chat(srv).status_code == 200


def test_huge_max_tokens_is_bounded_by_the_context(fuzz_server: Server) -> None:
    for value in (2**31, 2**63 - 1):
        r = _chat(fuzz_server, max_tokens=value, temperature=0)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] <= 1024
        else:
            assert_openai_error(r)
    r = _chat(fuzz_server, max_tokens=2**64)  # beyond int64: clamped to the context like the rest
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 1024
    _alive(fuzz_server)


def test_prompt_longer_than_the_context_is_a_clear_400(fuzz_server: Server) -> None:
    long_text = "hello world " * 3000  # far beyond n_ctx 1024
    pid = fuzz_server.worker()["pid"]
    r = _chat(fuzz_server, messages=[{"role": "user", "content": long_text}])
    assert r.status_code == 400, r.text
    assert assert_openai_error(r)["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"
    # It says how to get a longer context.
    assert "n_ctx" in r.json()["error"]["message"] and "/load" in r.json()["error"]["message"]
    r = httpx.post(fuzz_server.base_url + "/v1/completions", timeout=REQUEST_TIMEOUT,
                   json={"model": fuzz_server.model, "prompt": long_text})
    assert r.status_code == 400, r.text
    assert assert_openai_error(r)["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    r = httpx.post(fuzz_server.base_url + "/v1/responses", timeout=REQUEST_TIMEOUT,
                   json={"model": fuzz_server.model, "input": long_text, "store": False})
    assert r.status_code == 400, r.text
    assert assert_openai_error(r)["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input"
    assert fuzz_server.worker()["pid"] == pid, "the worker crashed on a long prompt"
    _alive(fuzz_server)


def test_long_max_length_is_served_not_a_worker_crash(fuzz_server: Server) -> None:
    # llama-cpp-python's converter wrote maxLength out as 10,000 nested groups,
    # which overflowed llama.cpp's parser; ours bounds strings by max_tokens.
    pid = fuzz_server.worker()["pid"]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "maxLength": 10_000}}}
    r = _chat(fuzz_server, response_format=fmt, max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith('"')
    assert fuzz_server.worker()["pid"] == pid, "the worker crashed"


@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": 10**9},  # the schema converter ran out of memory
    {"type": "string", "pattern": "^a{0,100000}$"},
    {"type": "nonsense"},
    {"$ref": "#/nowhere"},
    {"type": "object", "properties": {"a": 5}},
])
def test_hostile_json_schemas_are_400_not_a_worker_crash(fuzz_server: Server, schema: dict[str, Any]) -> None:
    pid = fuzz_server.worker()["pid"]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = _chat(fuzz_server, response_format=fmt)
    assert r.status_code == 400, r.text
    assert assert_openai_error(r)["code"] == "invalid_grammar"
    assert r.json()["error"]["param"] == "response_format"
    r = httpx.post(fuzz_server.base_url + "/v1/responses", timeout=REQUEST_TIMEOUT, json={
        "model": fuzz_server.model, "input": "hi", "store": False, "max_output_tokens": 4,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}})
    assert r.status_code == 400, r.text
    assert assert_openai_error(r)["code"] == "invalid_grammar"
    assert r.json()["error"]["param"] == "text.format"
    assert fuzz_server.worker()["pid"] == pid, "the worker crashed"


def test_unsendable_ints_do_not_wedge_the_worker(fuzz_server: Server) -> None:
    # 2**64 fits JSON but not the IPC encoding: the request fails alone, the
    # next one is served (before the fix the worker's slot stayed taken). A
    # token limit that large is clamped to the context before it is sent.
    r = _chat(fuzz_server, seed=-(2**64))
    assert r.status_code == 400, r.text
    assert_openai_error(r)
    assert _chat(fuzz_server, timeout=10).status_code == 200
    r = httpx.post(fuzz_server.base_url + "/v1/responses", timeout=REQUEST_TIMEOUT, json={
        "model": fuzz_server.model, "input": "hi", "store": False, "max_output_tokens": 2**64})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] <= 1024
    assert _chat(fuzz_server, timeout=10).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/api/jobs"])
def test_deeply_nested_json(fuzz_server: Server, path: str) -> None:
    for depth in (1000, 100_000):
        nested = b'{"model":"tiny","x":' + b"[" * depth + b"]" * depth + b"}"
        r = httpx.post(fuzz_server.base_url + path, content=nested, timeout=REQUEST_TIMEOUT,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (depth, r.text[:300])
        assert_openai_error(r)
    _alive(fuzz_server)


@pytest.mark.parametrize("body", [
    b'{"model":"tiny","messages":[{"role":"user","content":"\xff\xfe"}]}',
    b'{"model":"tiny","messages":[{"role":"user","content":"\xed\xa0\x80"}]}',  # a lone surrogate
    b'{"model":"\xc3","messages":[]}',
    b"\x00\x01\x02",
])
def test_invalid_utf8(fuzz_server: Server, body: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/responses", "/api/jobs"):
        r = httpx.post(fuzz_server.base_url + path, content=body, timeout=REQUEST_TIMEOUT,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.text[:300])
        assert_openai_error(r)


def test_escaped_lone_surrogate_in_a_prompt(fuzz_server: Server) -> None:
    # Valid JSON, but "\ud800" is no Unicode scalar value: the worker must not crash.
    body = b'{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"a\\ud800b"}]}'
    r = httpx.post(fuzz_server.base_url + "/v1/chat/completions", content=body, timeout=REQUEST_TIMEOUT,
                   headers={"Content-Type": "application/json"})
    assert_acceptable(r, "lone surrogate")
    assert r.status_code in (200, 400), r.text
    _alive(fuzz_server)


def _raw_connection(srv: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=REQUEST_TIMEOUT)


def test_a_body_that_never_finishes_does_not_block_others(fuzz_server: Server) -> None:
    stalled = []
    try:
        for _ in range(20):
            s = _raw_connection(fuzz_server)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n{\"model\": \"tiny\", ")
            stalled.append(s)
        # Slowloris on the headers, too.
        s = _raw_connection(fuzz_server)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        stalled.append(s)
        t0 = time.monotonic()
        _alive(fuzz_server)
        assert httpx.get(fuzz_server.base_url + "/healthz", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 10
    finally:
        for s in stalled:
            s.close()
    _alive(fuzz_server)


def test_header_floods(fuzz_server: Server) -> None:
    url = fuzz_server.base_url + "/v1/models"
    many = {f"X-Flood-{i}": "x" for i in range(500)}
    r = httpx.get(url, headers=many, timeout=REQUEST_TIMEOUT)
    assert r.status_code in (200, 400, 431), r.status_code
    huge = {"X-Huge": "y" * 200_000}
    try:
        r = httpx.get(url, headers=huge, timeout=REQUEST_TIMEOUT)
        assert r.status_code in (400, 431), r.status_code
    except httpx.RemoteProtocolError:
        pass  # closing the connection on an oversized header is an acceptable answer
    # The raw form: thousands of header lines on one connection.
    with _raw_connection(fuzz_server) as s:
        lines = b"".join(b"X-%d: %s\r\n" % (i, b"z" * 100) for i in range(10_000))
        try:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + lines + b"\r\n")
            head = s.recv(200)
        except (BrokenPipeError, ConnectionResetError):
            head = b""
        assert not head or head.split(b" ")[1][:1] in (b"2", b"4"), head
    _alive(fuzz_server)


def test_ten_thousand_tools(fuzz_server: Server) -> None:
    tools = [{"type": "function", "name": f"tool_{i}", "description": "does a thing",
              "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}
             for i in range(10_000)]
    r = httpx.post(fuzz_server.base_url + "/v1/responses", timeout=120, json={
        "model": fuzz_server.model, "input": "hi", "tools": tools, "store": False, "max_output_tokens": 4})
    assert r.status_code in (200, 400, 413), r.text[:300]
    if r.status_code != 200:
        assert_openai_error(r)
    chat_tools = [{"type": "function", "function": t | {"type": None}} for t in tools]
    r = _chat(fuzz_server, timeout=120, tools=chat_tools)
    assert r.status_code in (200, 400, 413), r.text[:300]
    if r.status_code != 200:
        assert_openai_error(r)
    _alive(fuzz_server)


TRAVERSALS = [
    "../../../../etc/passwd",
    "/etc/passwd",
    "..%2F..%2Fetc%2Fpasswd",
    "....//....//etc/passwd",
    "models/../../../etc/passwd",
    "a\x00b",
    "~/.ssh/id_rsa",
]


# A value that would pass each kind's required fields, so the field under test decides.
BASE_PARAMS: dict[str, dict[str, Any]] = {
    "dataset": {"input": "x.jsonl"},
    "quantize": {"model": "tiny", "type": "Q8_0"},
    "download": {"repo_id": "owner/name"},
    "finetune": {"model": "tiny", "train": "x.jsonl"},
    "export": {"model": "tiny"},
}


def _string_fields(struct: type) -> list[str]:
    import msgspec

    out = []
    for f in msgspec.structs.fields(struct):
        if f.type is str or f.type == (str | None):
            out.append(f.name)
    return out


def _inside(value: str, roots: list[Path]) -> bool:
    path = Path(value).resolve()
    return any(path.is_relative_to(r.resolve()) for r in roots)


def test_path_traversal_in_every_job_param(fuzz_server: Server) -> None:
    from jobs.kinds import job_kinds

    srv = fuzz_server
    roots = [srv.models_dir, srv.state_dir / "models", srv.state_dir / "datasets", srv.state_dir / "outputs"]
    (srv.state_dir / "datasets").mkdir(exist_ok=True)
    (srv.state_dir / "datasets" / "x.jsonl").write_text('{"text": "x"}\n')
    checked = 0
    for kind, spec in job_kinds().items():
        for name in _string_fields(spec.params):
            for bad in TRAVERSALS:
                params = {**BASE_PARAMS.get(kind, {}), name: bad}
                r = httpx.post(srv.base_url + "/api/jobs", timeout=REQUEST_TIMEOUT,
                               json={"kind": kind, "params": params})
                checked += 1
                if r.status_code == 400:
                    assert_openai_error(r)
                    continue
                # Accepted (a name that is no path, say a tag): nothing stored may point outside.
                assert r.status_code in (200, 201), (kind, name, bad, r.text)
                job = r.json()
                httpx.post(f"{srv.base_url}/api/jobs/{job['id']}/cancel", timeout=REQUEST_TIMEOUT)
                for key, value in job["params"].items():
                    if isinstance(value, str) and value.startswith("/"):
                        assert _inside(value, roots), (kind, key, value)
                    assert not (isinstance(value, str) and ".." in Path(value).parts), (kind, key, value)
    assert checked > 50


def test_path_traversal_in_url_params(fuzz_server: Server) -> None:
    base = fuzz_server.base_url
    templates = ["/api/models/{}", "/api/models/{}/load", "/api/jobs/{}", "/api/jobs/{}/log",
                 "/static/{}", "/v1/responses/{}", "/v1/responses/{}/input_items"]
    for template in templates:
        for bad in ("..%2F..%2Fetc%2Fpasswd", "%2E%2E%2F%2E%2E%2Fetc%2Fpasswd", "..%5C..%5Cwin.ini",
                    "%00", "tiny%2F..%2F..%2F..%2Fetc%2Fpasswd"):
            url = base + template.format(bad)
            method = "POST" if template.endswith("/load") else "GET"
            r = httpx.request(method, url, timeout=REQUEST_TIMEOUT)
            assert r.status_code in (400, 404), (url, r.status_code, r.text[:200])
            assert "root:" not in r.text
            assert_openai_error(r, url)
    # Upload names are reduced to a plain name inside the datasets directory.
    files = {"file": ("../../../../tmp/evil.jsonl", b'{"text": "x"}\n', "application/json")}
    r = httpx.post(base + "/api/datasets", files=files, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 201, r.text
    assert "/" not in r.json()["name"] and ".." not in r.json()["name"]


def test_dataset_symlink_out_of_the_roots_is_refused(fuzz_server: Server) -> None:
    datasets = fuzz_server.state_dir / "datasets"
    datasets.mkdir(exist_ok=True)
    link = datasets / "escape.jsonl"
    link.unlink(missing_ok=True)
    link.symlink_to("/etc/passwd")
    r = httpx.post(fuzz_server.base_url + "/api/jobs", timeout=REQUEST_TIMEOUT,
                   json={"kind": "dataset", "params": {"input": "escape.jsonl"}})
    assert r.status_code == 400, r.text
    assert assert_openai_error(r)["param"] == "params.input"


def test_malformed_requests_keep_the_shape(fuzz_server: Server) -> None:
    base = fuzz_server.base_url
    cases: list[tuple[str, str, bytes | None, Callable[[int], bool]]] = [
        ("POST", "/v1/chat/completions", b"", lambda s: s == 400),
        ("POST", "/v1/chat/completions", b"[]", lambda s: s == 400),
        ("POST", "/v1/chat/completions", json.dumps({"model": 1}).encode(), lambda s: s == 400),
        ("POST", "/v1/chat/completions", b"{" * 10, lambda s: s == 400),
        ("PUT", "/v1/chat/completions", b"{}", lambda s: s == 405),
        ("GET", "/v1/nope", None, lambda s: s == 404),
        ("POST", "/v1/embeddings", b'{"model":"tiny","input":[]}', lambda s: s == 400),
    ]
    for method, path, body, ok in cases:
        r = httpx.request(method, base + path, content=body, timeout=REQUEST_TIMEOUT,
                          headers={"Content-Type": "application/json"})
        assert ok(r.status_code), (method, path, r.status_code, r.text[:200])
        assert_openai_error(r, path)


def test_a_stalled_body_gets_408_and_the_connection_closes(
        tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = start_server(models, env={"GPUVISOR_BODY_TIMEOUT": "1"})
    with _raw_connection(srv) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n{\"model\": \"tiny\", ")
        received = b""
        while chunk := s.recv(65536):  # ends when the server closes the connection
            received += chunk
        assert time.monotonic() - t0 < 10
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received[:300]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    _alive(srv)


def test_deeply_nested_tool_parameters_are_a_400(fuzz_server: Server) -> None:
    # 400 levels overflowed the parent's grammar builder: a 500 before.
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(400):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    r = _chat(fuzz_server, tool_choice="required",
              tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"
    r = httpx.post(fuzz_server.base_url + "/v1/responses", timeout=REQUEST_TIMEOUT, json={
        "model": fuzz_server.model, "input": "hi", "store": False, "max_output_tokens": 4,
        "tool_choice": "required", "tools": [{"type": "function", "name": "f", "parameters": schema}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"
    _alive(fuzz_server)


@pytest.mark.parametrize("field,value", [("top_k", -1), ("top_k", 2**21), ("min_p", 5.0), ("min_p", -0.1),
                                         ("repeat_penalty", -1.0), ("repeat_penalty", 9.0)])
def test_llama_sampling_fields_out_of_range_are_a_400(fuzz_server: Server, field: str, value: float) -> None:
    r = _chat(fuzz_server, **{field: value})
    assert r.status_code == 400, r.text
    assert assert_openai_error(r)["param"] == field
