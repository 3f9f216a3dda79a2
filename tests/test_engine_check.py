"""A CPU-only engine build on a machine with NVIDIA GPUs is called out."""

from __future__ import annotations

import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.server import Server, short_tempdir

FAKE_SMI = """#!/bin/sh
# Answers the memory queries like a machine with one 24 GiB GPU.
case "$1" in
  *name*) echo "0, GPU-00000000-0000-0000-0000-000000000000, Fake GPU, 24000, 24576" ;;
  *) echo "0, GPU-00000000-0000-0000-0000-000000000000, 24000, 24576" ;;
esac
"""


def _fake_smi_path() -> str:
    bindir = short_tempdir("gvb")
    smi = bindir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"


def _checked_engine(srv: Server, timeout: float = 60) -> dict[str, object]:
    """``/api/gpu``'s engine part once the start-up check has run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engine = dict(httpx.get(srv.base_url + "/api/gpu", timeout=10).json()["engine"])
        if engine["checked"]:
            return engine
        time.sleep(0.05)
    raise TimeoutError("the engine check never finished")


def test_cpu_engine_on_a_gpu_machine_is_reported(tiny_model_path: Path,
                                                 start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = start_server(models, env={"PATH": _fake_smi_path()})
    engine = _checked_engine(srv)
    assert engine["machine_gpus"] == 1 and engine["engine_gpus"] == []
    assert engine["engine_gpu"] is False
    assert "CPU build" in str(engine["warning"])
    assert srv.log_text().count("installed engine is its CPU build") == 1


def test_cpu_engine_on_an_amd_machine_is_reported(tiny_model_path: Path,
                                                  start_server: Callable[..., Server]) -> None:
    # No nvidia-smi; amd-smi answers as on a machine with two MI300X.
    fixtures = Path(__file__).parent / "fixtures" / "gpu"
    bindir = short_tempdir("gvb")
    tool = bindir / "amd-smi"
    tool.write_text(f"#!{sys.executable}\nimport sys\n"
                    f"name = 'amd_smi_static_asic.json' if sys.argv[1] == 'static' else 'amd_smi_metric_mem.json'\n"
                    f"sys.stdout.write(open({str(fixtures)!r} + '/' + name).read())\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = start_server(models, env={"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"})
    engine = _checked_engine(srv)
    assert engine["machine_gpus"] == 2 and engine["engine_gpu"] is False
    assert "the driver shows 2 GPU(s)" in str(engine["warning"])
    devices = httpx.get(srv.base_url + "/api/gpu", timeout=10).json()["devices"]
    assert [(d["id"], d["name"]) for d in devices] == [("cuda:0", "AMD Instinct MI300X"),
                                                       ("cuda:1", "AMD Instinct MI300X")]


def test_no_gpu_no_warning(server: Server) -> None:
    engine = _checked_engine(server)
    assert engine["engine_gpu"] is True and engine["warning"] is None


def test_overview_shows_the_cpu_engine_warning(tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    from tests.browser import PageWatch, launch, require_browser

    require_browser()
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = start_server(models, env={"PATH": _fake_smi_path()})
    _checked_engine(srv)
    with launch() as browser:
        pg = browser.new_page()
        watch = PageWatch(srv.base_url)
        watch.attach(pg)
        pg.goto(f"{srv.base_url}/#/")
        notice = pg.locator(".engine-warning")
        notice.wait_for(timeout=15000)
        assert "CPU build" in notice.inner_text()
        watch.check()
