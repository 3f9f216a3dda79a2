"""AMD GPUs read as GPUs: amd-smi, rocm-smi and sysfs readings, fake tools on
PATH that answer, hang or babble, the source that picks NVIDIA or AMD, and the
pinning a ROCm child needs.

The files in tests/fixtures/gpu are outputs in the shapes amd-smi (ROCm 6:
a bare list; later releases: a ``gpu_data`` wrapper, amounts that may be
"N/A") and rocm-smi (``cardN`` objects of strings in bytes, a ``system``
entry beside them) print, with values as public reports of those tools show
them (two MI300X; an RX 7900 XT beside an APU).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from supervisor.lab.gpu_setup import build_lease
from supervisor.models.amd_smi import AmdSource, parse_amd_smi, parse_rocm_smi, read_sysfs
from supervisor.models.devices import (
    MIB,
    DeviceReadError,
    GpuReading,
    RecordedSource,
    SystemSource,
    gpu_box,
    pinned_environ,
)
from supervisor.models.smi_run import OutputTooLarge, run_tool

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


def _text(name: str) -> str:
    return (FIXTURES / name).read_text()


def _mib(readings: list[GpuReading]) -> list[tuple[int, str, int, int]]:
    return [(r.index, r.name, r.free_bytes // MIB, r.total_bytes // MIB) for r in readings]


def test_amd_smi_readings_have_the_nvidia_shape() -> None:
    gpus = parse_amd_smi(_text("amd_smi_metric_mem.json"), _text("amd_smi_static_asic.json"))
    assert _mib(gpus) == [(0, "AMD Instinct MI300X", 196309, 196592),
                          (1, "AMD Instinct MI300X", 114672, 196592)]
    assert [g.device_id for g in gpus] == ["cuda:0", "cuda:1"]
    # The form ROCR_VISIBLE_DEVICES accepts besides an index.
    assert gpus[0].uuid == "GPU-6e1c7f2a45d3b890"
    # Without the static names the memory is still the reading.
    plain = parse_amd_smi(_text("amd_smi_metric_mem.json"), "not json")
    assert [g.name for g in plain] == ["AMD GPU 0", "AMD GPU 1"] and plain[1].free_bytes == gpus[1].free_bytes


def test_newer_amd_smi_wrapper_and_free_from_total_minus_used() -> None:
    (gpu,) = parse_amd_smi(_text("amd_smi_metric_mem_gpu_data.json"))
    assert _mib([gpu]) == [(0, "AMD GPU 0", 36 * 1024, 48 * 1024)]


def test_rocm_smi_cards_in_bytes_and_other_entries_skipped() -> None:
    gpus = parse_rocm_smi(_text("rocm_smi_meminfo.json"))
    assert [(g.index, g.name, g.free_bytes, g.total_bytes) for g in gpus] == [
        (0, "Radeon RX 7900 XT", 21458059264 - 27856896, 21458059264),
        (1, "0x15bf", 4294967296 - 72495104, 4294967296)]
    assert gpus[0].uuid == "GPU-9a6b2c1d0e3f4a5b" and gpus[1].uuid == "AMD-GPU-1"
    # A warning printed before the JSON does not spoil it.
    warned = "WARNING: AMD GPU device(s) is/are in a low-power state.\n" + _text("rocm_smi_meminfo.json")
    assert parse_rocm_smi(warned) == gpus


@pytest.mark.parametrize(("parse", "text", "says"), [
    (parse_amd_smi, "", "amd-smi printed no JSON"),
    (parse_amd_smi, "ERROR: Unable to detect any GPU devices\n", "amd-smi printed no JSON"),
    (parse_amd_smi, '{"gpu_data": 3}', "expected a list"),
    (parse_amd_smi, '[{"gpu": 0, "mem_usage": {"total_vram": "N/A", "free_vram": "N/A"}}]', "GPU 0"),
    (parse_amd_smi, '[{"gpu": 2, "mem_usage": {"total_vram": {"value": -5, "unit": "MB"},'
                    ' "free_vram": {"value": 1, "unit": "MB"}}}]', "GPU 2"),
    (parse_amd_smi, '[{"gpu": 0, "mem_usage": {"total_vram": {"value": true, "unit": "MB"},'
                    ' "free_vram": {"value": 1, "unit": "parsecs"}}}]', "GPU 0"),
    (parse_rocm_smi, '{"card0": {"VRAM Total Memory (B)": "lots", "VRAM Total Used Memory (B)": "0"}}',
     "card0"),
    (parse_rocm_smi, '{"card3": {"Card Series": "x"}}', "card3"),
    (parse_rocm_smi, "[1, 2]", "expected an object"),
])
def test_odd_output_is_a_clear_read_error(parse: object, text: str, says: str) -> None:
    assert callable(parse)
    with pytest.raises(DeviceReadError, match=says):
        parse(text)


def test_odd_but_harmless_entries() -> None:
    # Entries without a GPU index (a CPU's, a bool) are no GPUs; no GPU is an empty reading.
    text = json.dumps([{"cpu": 0}, {"gpu": True}, {"gpu": 1, "mem_usage": {
        "total_vram": {"value": 1024, "unit": "MB"}, "free_vram": {"value": 4096, "unit": "MB"}}}])
    static = json.dumps([{"gpu": 1, "asic": {"market_name": "Evil\x1b[2J\nName" + "x" * 500}}])
    (gpu,) = parse_amd_smi(text, static)
    assert gpu.free_bytes == gpu.total_bytes == 1024 * MIB  # never more free than there is
    assert gpu.name.startswith("Evil[2JName") and len(gpu.name) == 128
    assert parse_amd_smi("[]") == [] and parse_rocm_smi("{}") == []


# ------------------------------------------------------------------ fake tools


def _tool(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text(f"#!{sys.executable}\nimport sys, time, subprocess\n{body}\n")
    path.chmod(0o755)


def _answer(fixture: str) -> str:
    return f"sys.stdout.write(open({str(FIXTURES / fixture)!r}).read())"


@pytest.fixture
def bindir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH holding only the fake tools: no real one on this machine answers."""
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", str(path))
    return path


def test_fake_amd_smi_on_path(bindir: Path, tmp_path: Path) -> None:
    _tool(bindir, "amd-smi", "\n".join([
        "if sys.argv[1] == 'static':",
        "    " + _answer("amd_smi_static_asic.json"),
        "else:",
        "    " + _answer("amd_smi_metric_mem.json")]))
    source = AmdSource(drm=tmp_path / "no-drm")
    assert _mib(source.read())[1] == (1, "AMD Instinct MI300X", 114672, 196592)
    lease_gpus = SystemSource().read()  # nvidia-smi is not installed here
    assert [g.device_id for g in lease_gpus] == ["cuda:0", "cuda:1"]


def test_a_hanging_amd_smi_falls_back_to_rocm_smi_in_bounded_time(bindir: Path, tmp_path: Path) -> None:
    _tool(bindir, "amd-smi", "time.sleep(60)")
    _tool(bindir, "rocm-smi", _answer("rocm_smi_meminfo.json"))
    start = time.monotonic()
    gpus = AmdSource(timeout=0.5, drm=tmp_path / "no-drm").read()
    assert time.monotonic() - start < 10
    assert [g.name for g in gpus] == ["Radeon RX 7900 XT", "0x15bf"]


def test_every_tool_failing_is_one_error_naming_each(bindir: Path, tmp_path: Path) -> None:
    _tool(bindir, "amd-smi", "time.sleep(60)")
    _tool(bindir, "rocm-smi", "print('segfault'); sys.exit(139)")
    start = time.monotonic()
    with pytest.raises(DeviceReadError) as err:
        AmdSource(timeout=0.5, drm=tmp_path / "no-drm").read()
    assert time.monotonic() - start < 10
    assert "amd-smi did not answer within 0.5 s" in str(err.value) and "rocm-smi failed" in str(err.value)
    # No tool at all and no amdgpu card: no GPU, not an error.
    for tool in bindir.iterdir():
        tool.unlink()
    assert AmdSource(drm=tmp_path / "no-drm").read() == []


def test_a_tool_whose_child_keeps_stdout_open_is_killed_with_it(bindir: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    _tool(bindir, "amd-smi", "\n".join([
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])",
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))",
        "print('[]')"]))
    with pytest.raises(Exception) as err:
        run_tool(["amd-smi", "metric"], timeout=1.0)
    assert type(err.value).__name__ == "TimeoutExpired"
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone for our purpose


def test_endless_output_is_cut_off(bindir: Path) -> None:
    _tool(bindir, "rocm-smi", "while True: sys.stdout.write('{' * 65536)")
    with pytest.raises(OutputTooLarge):
        run_tool(["rocm-smi"], timeout=10.0, limit=1 << 20)


# ------------------------------------------------------------------ sysfs, choice, lease


def _card(drm: Path, name: str, vendor: str, total: int | None, used: int = 0) -> None:
    dev = drm / name / "device"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text(vendor + "\n")
    if total is not None:
        (dev / "mem_info_vram_total").write_text(f"{total}\n")
        (dev / "mem_info_vram_used").write_text(f"{used}\n")


def test_sysfs_reads_amdgpu_cards_without_any_tool(tmp_path: Path) -> None:
    drm = tmp_path / "drm"
    _card(drm, "card0", "0x8086", None)  # an Intel display GPU
    _card(drm, "card1", "0x1002", 17163091968, 1073741824)
    _card(drm, "card2", "0x1002", None)  # an AMD card without VRAM files
    (drm / "card1-DP-1").mkdir()  # a connector
    (gpu,) = read_sysfs(drm)
    assert (gpu.index, gpu.name, gpu.free_bytes, gpu.total_bytes) == (
        0, "AMD GPU (card1)", 17163091968 - 1073741824, 17163091968)
    (drm / "card1" / "device" / "mem_info_vram_used").write_text("garbage\n")
    with pytest.raises(DeviceReadError, match="card1"):
        read_sysfs(drm)


def test_the_parents_rocr_visible_devices_limit_amd_gpus(bindir: Path, tmp_path: Path) -> None:
    _tool(bindir, "rocm-smi", _answer("rocm_smi_meminfo.json"))
    only_apu = AmdSource(drm=tmp_path / "x", environ={"ROCR_VISIBLE_DEVICES": "1"}).read()
    assert [g.index for g in only_apu] == [1]
    by_uuid = AmdSource(drm=tmp_path / "x", environ={"ROCR_VISIBLE_DEVICES": "GPU-9a6b"}).read()
    assert [g.index for g in by_uuid] == [0]


class Failing(RecordedSource):
    def read(self) -> list[GpuReading]:
        self.reads += 1
        raise DeviceReadError("nvidia-smi failed: NVIDIA-SMI has failed because it couldn't "
                              "communicate with the NVIDIA driver")


async def test_an_amd_box_gets_a_lease_of_its_gpus() -> None:
    nvidia = Failing([[]])
    amd = RecordedSource([parse_amd_smi(_text("amd_smi_metric_mem.json"), _text("amd_smi_static_asic.json"))])
    source = SystemSource([("nvidia-smi", nvidia), ("amd", amd)])
    lease = await build_lease(source=source)
    assert lease.devices == ["cuda:0", "cuda:1"] and lease.gpu_indices(lease.devices) == [0, 1]
    assert source.chosen == "amd"
    snap = lease.snapshot(source.read())["devices"]
    assert snap[1]["name"] == "AMD Instinct MI300X"
    assert snap[1]["memory"] == {"free_mib": 114672, "total_mib": 196592}
    assert nvidia.reads == 1  # the broken nvidia-smi is not asked again


def test_nvidia_first_and_every_failure_named() -> None:
    both = SystemSource([("nvidia-smi", RecordedSource([gpu_box([1000])])), ("amd", Failing([[]]))])
    assert [g.name for g in both.read()] == ["Simulated GPU"] and both.chosen == "nvidia-smi"
    none = SystemSource([("nvidia-smi", RecordedSource([[]])), ("amd", RecordedSource([[]]))])
    assert none.read() == [] and none.chosen is None
    broken = SystemSource([("nvidia-smi", Failing([[]])), ("amd", Failing([[]]))])
    with pytest.raises(DeviceReadError, match="NVIDIA driver.*; nvidia-smi failed"):
        broken.read()


def test_rocm_pinning_counts_hip_within_rocr() -> None:
    # ROCr keeps GPUs 3 and 1; HIP then numbers them 0 and 1. The same
    # machine index in HIP_VISIBLE_DEVICES would hide the second GPU.
    env = pinned_environ([3, 1])
    assert env["ROCR_VISIBLE_DEVICES"] == "3,1" and env["HIP_VISIBLE_DEVICES"] == "0,1"
    assert env["CUDA_VISIBLE_DEVICES"] == "3,1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert pinned_environ([1])["HIP_VISIBLE_DEVICES"] == "0"
    hidden = pinned_environ([])
    assert hidden["CUDA_VISIBLE_DEVICES"] == hidden["ROCR_VISIBLE_DEVICES"] == hidden["HIP_VISIBLE_DEVICES"] == ""
