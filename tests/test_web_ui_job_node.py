"""The new-job form's Node choice and the job page's node, in headless
Chromium against a real gpuvisor in this process whose cluster is two node
agents in this process too (tests/agent_nodes.py: the runner's JobNodes
without Ray). A person picks a node, submits a quantize, and the job runs
there; without a cluster the form offers no node."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.app import build_app
from supervisor.appkeys import JOB_NODES, LEASE
from supervisor.config import load_config
from supervisor.models.devices import GpuReading
from supervisor.service.serving import Service
from supervisor.service.systemd import Notifier
from supervisor.workers.node_agent import NodeAgent
from tests.agent_nodes import AgentNodes
from tests.browser import new_page
from tests.test_job_estimate import write_model
from tests.server import poll_until, short_tempdir

pytestmark = pytest.mark.timeout(180)
GIB = 1 << 30


@contextmanager
def served(tiny_model_path: Path, nodes: AgentNodes | None,
           finetune: bool = False) -> Iterator[tuple[str, Any]]:
    """A whole gpuvisor app served on loopback from a thread of its own (its
    base URL and app); ``nodes`` is its cluster as the job runner sees it.
    ``finetune``: a small Hugging Face model and a dataset to fine-tune on."""
    state = short_tempdir("gvs")
    models = state / "models"
    models.mkdir()
    # Two models, so that none is preloaded: no worker is needed here.
    for name in ("tiny.gguf", "tiny-b.gguf"):
        (models / name).symlink_to(tiny_model_path)
    if finetune:
        write_model(models / "tiny-ft")
        (state / "datasets").mkdir()
        (state / "datasets" / "chat.jsonl").write_text(
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    cfg = load_config({"state_dir": str(state), "models_dir": str(models)},
                      environ={"GPUVISOR_PORT": "0", "OMP_NUM_THREADS": "1"})
    app = build_app(cfg)
    if nodes is not None:
        app[JOB_NODES] = nodes
    service = Service(cfg, app, Notifier(None))
    loop = asyncio.new_event_loop()
    sock = socket.create_server(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=loop.run_until_complete, args=(service.run(sock),), daemon=True)
    thread.start()
    try:
        poll_until(lambda: _healthy(base), bool, timeout=60)
        yield base, (app, loop)
    finally:
        loop.call_soon_threadsafe(service.stopping.set)
        thread.join(60)
        assert not thread.is_alive(), "the app did not stop"
        loop.close()
        sock.close()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _book_gpus(served_app: Any, node: str, count: int) -> None:
    """The node's GPUs as its agent's reading gives them to the lease (what
    the cluster watch does with Ray), so the choice can say what it has."""
    app, loop = served_app

    async def book() -> None:
        app[LEASE].set_node(node, [GpuReading(index=i, uuid=f"GPU-{node}-{i}", name="Sim", free_bytes=20 * GIB,
                                              total_bytes=24 * GIB, node=node) for i in range(count)])

    asyncio.run_coroutine_threadsafe(book(), loop).result(10)


def _job(base: str, job_id: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{base}/api/jobs/{job_id}", timeout=10).json()
    return body


def test_a_person_runs_a_quantize_on_a_node_they_pick(browser: Any, tiny_model_path: Path) -> None:
    nodes = AgentNodes({"node-b": NodeAgent(str(short_tempdir("gvj"))),
                        "node-c": NodeAgent(str(short_tempdir("gvj")))})
    with served(tiny_model_path, nodes) as (base, served_app):
        _book_gpus(served_app, "node-b", 2)
        listed = httpx.get(f"{base}/api/jobs/nodes", timeout=10).json()
        assert listed["cluster"] is True
        assert [(n["name"], n["devices"]) for n in listed["data"]] == [
            ("node-b", ["node-b/cuda:0", "node-b/cuda:1"]), ("node-c", [])]
        context, pg, watch = new_page(browser, base)
        try:
            pg.goto(f"{base}/#/jobs?new=quantize")
            form = pg.locator("form#submit-quantize")
            node = form.locator('[data-field="node"]')
            choice = node.locator("select")
            choice.wait_for()
            assert node.locator("label").inner_text().strip() == "Node"
            assert [o.strip() for o in choice.locator("option").all_inner_texts()] == [
                "this machine", "node-b · 2 GPUs", "node-c · no GPU"]
            form.locator('[data-field="model"] input').fill("tiny")
            form.locator('[data-field="type"] select').select_option("Q8_0")
            choice.select_option("node-c")
            form.get_by_role("button", name="Submit quantize job").click()
            pg.wait_for_url("**/#/jobs/job_*")
            job_id = pg.url.rsplit("/", 1)[1]
            assert _job(base, job_id)["params"]["node"] == "node-c"
            done = poll_until(lambda: _job(base, job_id), lambda j: j["status"] not in ("queued", "running"),
                              timeout=120)
            assert done["status"] == "succeeded", done.get("error")
            assert done["node"] == "node-c"
            # Started by node-c's agent, not here and not on node-b.
            assert [j.node for j in nodes.started] == ["node-c"]
            # The job page says where it ran, once it shows the job finished.
            ran_on = pg.locator("dl.facts dt", has_text="Ran on")
            ran_on.wait_for(timeout=30_000)
            assert pg.locator("dd.job-node").inner_text() == "node node-c"
            watch.check()
        finally:
            context.close()


def test_without_a_cluster_the_form_offers_no_node(browser: Any, tiny_model_path: Path) -> None:
    with served(tiny_model_path, None) as (base, _):
        assert httpx.get(f"{base}/api/jobs/nodes", timeout=10).json() == {
            "object": "list", "cluster": False, "data": []}
        context, pg, watch = new_page(browser, base)
        try:
            pg.goto(f"{base}/#/jobs?new=quantize")
            form = pg.locator("form#submit-quantize")
            form.locator('[data-field="model"] input').wait_for()
            # The answer that keeps it hidden has come (the list of nodes), and it stayed hidden.
            pg.wait_for_load_state("networkidle")
            assert form.locator('[data-field="node"]').is_hidden()
            assert not form.get_by_label("Node").is_visible()
            # Nor does the fine-tune's, whose choice is the form's own.
            pg.goto(f"{base}/#/jobs?new=finetune")
            finetune = pg.locator("form#submit-finetune")
            finetune.locator('[data-field="model"] input').wait_for()
            pg.wait_for_load_state("networkidle")
            assert finetune.locator('[data-field="node"]').is_hidden()
            watch.check()
        finally:
            context.close()


class _SilentCluster(AgentNodes):
    """A cluster whose head does not answer when its nodes are listed."""

    async def node_names(self) -> list[str]:
        raise OSError("no answer from the Ray cluster at 10.0.0.1:6380")


def test_a_cluster_that_does_not_answer_leaves_the_node_field_saying_why(browser: Any,
                                                                         tiny_model_path: Path) -> None:
    with served(tiny_model_path, _SilentCluster({})) as (base, _):
        answer = httpx.get(f"{base}/api/jobs/nodes", timeout=10)
        assert answer.status_code == 503 and "no answer from the Ray cluster" in answer.json()["error"]["message"]
        context, pg, watch = new_page(browser, base)
        try:
            pg.goto(f"{base}/#/jobs?new=quantize")
            node = pg.locator('form#submit-quantize [data-field="node"]')
            node.locator("input").wait_for()  # shown, as a text field: no list to choose from
            help_text = node.locator(".field-help").inner_text()
            assert "could not be listed" in help_text and "no answer from the Ray cluster" in help_text, help_text
            # The browser reports the 503 itself; nothing else went wrong.
            watch.check(allow=("503",))
        finally:
            context.close()


def test_a_person_picks_a_node_for_a_finetune_and_its_estimate_follows(browser: Any, tiny_model_path: Path) -> None:
    """The fine-tune form's Node choice: a node's GPUs are sent as gpu_ids
    (the first as many as GPUs asks), the memory estimate is set against
    that node's GPUs, a count the node cannot give is refused before
    anything is sent, and the job runs on that node."""
    nodes = AgentNodes({"node-b": NodeAgent(str(short_tempdir("gvj"))),
                        "node-c": NodeAgent(str(short_tempdir("gvj")))})
    with served(tiny_model_path, nodes, finetune=True) as (base, served_app):
        _book_gpus(served_app, "node-b", 2)
        context, pg, watch = new_page(browser, base)
        try:
            pg.goto(f"{base}/#/jobs?new=finetune")
            form = pg.locator("form#submit-finetune")
            node = form.locator('[data-field="node"]')
            choice = node.locator("select")
            choice.wait_for()
            assert node.locator("label").inner_text().strip() == "Node"
            assert [o.strip() for o in choice.locator("option").all_inner_texts()] == [
                "this machine", "node-b · 2 GPUs", "node-c · no GPU"]
            # A node without a GPU cannot run a fine-tune: it cannot be picked.
            assert choice.locator('option[value="node-c"]').is_disabled()
            form.locator("details.more > summary").click()
            form.locator("#submit-finetune-model").fill("tiny-ft")
            form.locator("#submit-finetune-train").fill("chat.jsonl")
            devices = pg.locator(".estimate .estimate-devices")
            devices.wait_for()
            assert "node-b" not in devices.inner_text()
            choice.select_option("node-b")
            pg.wait_for_function("() => document.querySelector('.estimate .estimate-devices')"
                                 "?.textContent.startsWith('node-b/cuda:0')")
            assert devices.inner_text() == "node-b/cuda:0: 20.0 GiB free of 24.0 GiB"
            # Three GPUs of a node that has two: said in the estimate and under GPUs, and nothing is sent.
            form.locator("#submit-finetune-gpus").fill("3")
            refused = pg.locator(".estimate .estimate-none")
            refused.wait_for()
            assert refused.inner_text() == "No memory estimate: node node-b has 2 GPUs; GPUs asks 3"
            form.get_by_role("button", name="Submit finetune job").click()
            assert form.locator('[data-field="gpus"] .field-error').inner_text() == "node node-b has 2 GPUs; GPUs asks 3"
            assert nodes.started == []
            form.locator("#submit-finetune-gpus").fill("2")
            pg.wait_for_function("() => document.querySelector('.estimate .estimate-devices')"
                                 "?.textContent.includes('node-b/cuda:1')")
            assert devices.inner_text().split(" · ") == [
                "node-b/cuda:0: 20.0 GiB free of 24.0 GiB", "node-b/cuda:1: 20.0 GiB free of 24.0 GiB"]
            form.get_by_role("button", name="Submit finetune job").click()
            pg.wait_for_url("**/#/jobs/job_*")
            job_id = pg.url.rsplit("/", 1)[1]
            job = _job(base, job_id)
            assert job["params"]["gpu_ids"] == ["node-b/cuda:0", "node-b/cuda:1"] and "node" not in job["params"]
            started = poll_until(lambda: _job(base, job_id), lambda j: j["status"] != "queued", timeout=60)
            assert started["node"] == "node-b"
            assert [j.node for j in nodes.started] == ["node-b"]
            httpx.post(f"{base}/api/jobs/{job_id}/cancel", json={}, timeout=10)
            poll_until(lambda: _job(base, job_id), lambda j: j["status"] not in ("queued", "running"), timeout=60)
            watch.check()
        finally:
            context.close()
