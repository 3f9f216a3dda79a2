"""GET /metrics, parsed with prometheus_client's own text parser."""

from __future__ import annotations

import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from supervisor.api.metrics import histogram_buckets
from tests.server import Server


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(family: Any, suffix: str = "", **labels: str) -> float:
    for s in family.samples:
        if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise KeyError((family.name + suffix, labels))


def test_metrics_cover_requests_models_lease_and_jobs(server: Server) -> None:
    url = server.base_url
    # The job first: it takes the (cpu) lease, which evicts the model worker.
    job = httpx.post(url + "/api/jobs", json={"kind": "sleep", "params": {"steps": 1, "step_seconds": 0}}).json()
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/api/jobs/{job['id']}").json()["status"] != "succeeded":
        assert time.monotonic() < deadline, "the sleep job did not finish"
        time.sleep(0.1)
    body = {"model": server.model, "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and sum(1 for _ in r.iter_lines()) > 3
    assert httpx.get(url + "/api/jobs/missing").status_code == 404

    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    fams = _families(r.text)
    req = fams["gpuvisor_http_requests"]
    assert req.type == "counter"
    assert _value(req, "_total", route="/v1/chat/completions", method="POST", status="200") == 2
    assert _value(req, "_total", route="/api/jobs/{id}", method="GET", status="404") == 1
    model = server.model
    ttft = fams["gpuvisor_time_to_first_token_seconds"]
    assert ttft.type == "histogram" and _value(ttft, "_count", model=model) == 2
    assert _value(fams["gpuvisor_decode_tokens_per_second"], "_count", model=model) == 2
    assert _value(fams["gpuvisor_completion_tokens"], "_total", model=model) == 16
    assert _value(fams["gpuvisor_queue_depth"], model=model, mode="generate") == 0
    assert _value(fams["gpuvisor_worker_state"], model=model, state="ready") == 1
    assert _value(fams["gpuvisor_worker_restarts"], "_total", model=model) == 0
    assert _value(fams["gpuvisor_models_loaded"]) >= 1
    assert _value(fams["gpuvisor_lease_held"], device="cpu") == 0
    assert _value(fams["gpuvisor_lease_waiters"]) == 0
    assert _value(fams["gpuvisor_jobs"], status="succeeded", kind="sleep") == 1
    durations = fams["gpuvisor_job_duration_seconds"]
    assert durations.type == "histogram"
    assert _value(durations, "_count", kind="sleep", status="succeeded") == 1
    assert "gpuvisor_http_request_duration_seconds" in fams


def test_histogram_buckets_are_cumulative() -> None:
    assert histogram_buckets([0.5, 2, 2, 50], [1, 10]) == [("1.0", 1.0), ("10.0", 3.0), ("+Inf", 4.0)]
