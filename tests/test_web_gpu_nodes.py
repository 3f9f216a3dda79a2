"""The lab's overview with a cluster's devices: its GPU card groups them by
node, in headless Chromium against a real gpuvisor. The server here has no
cluster, so the devices of its /api/gpu answer are replaced by those of a
lease that books two nodes (the lease's own snapshot, so the shape is the
one a cluster gives; tests/test_ray_cluster.py checks the real answer)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from supervisor.lab.lease import GpuLease, cpu_device
from supervisor.models.devices import MIB, GpuReading
from tests.browser import DESKTOP
from tests.server import Server

pytestmark = pytest.mark.timeout(90)


def _cluster_devices() -> list[dict[str, Any]]:
    lease = GpuLease([cpu_device()])
    lease.set_node("node-a", [GpuReading(index=0, uuid="GPU-a", name="Sim GPU", free_bytes=8192 * MIB,
                                         total_bytes=24576 * MIB, node="node-a")])
    lease.set_node("node-c", [], ram=(32768 * MIB, 65536 * MIB))
    lease.book_worker("tiny", ["node-a/cuda:0"])
    devices: list[dict[str, Any]] = lease.snapshot()["devices"]
    return devices


def test_the_overview_groups_a_clusters_gpus_by_node(browser: Any, server: Server) -> None:
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(20_000)
    pg = context.new_page()

    def cluster_answer(route: Any) -> None:
        body = route.fetch().json()
        body["devices"] = _cluster_devices()
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    try:
        pg.route("**/api/gpu", cluster_answer)
        pg.goto(f"{server.base_url}/#/")
        card = pg.locator(".card", has_text="GPU lease")
        node_a = card.locator(".node-devices", has_text="Node node-a")
        node_a.locator(".device", has_text="node-a/cuda:0").wait_for()
        assert "8.0 GiB free" in node_a.inner_text(), node_a.inner_text()
        assert "running: tiny" in node_a.inner_text()
        assert "node-c/cpu" in card.locator(".node-devices", has_text="Node node-c").inner_text()
        here = card.locator(".node-devices", has_text="This machine (jobs)")
        assert "cpu" in here.inner_text() and "node-a" not in here.inner_text()
    finally:
        context.close()
