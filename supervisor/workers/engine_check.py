"""Does the installed engine build match the machine's GPUs?

A CPU-only engine on a machine with NVIDIA or AMD GPUs runs every model on the CPU
however many layers are asked for: say so once at start and in ``/api/gpu``.
The engine is probed in a subprocess (the parent never imports it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import msgspec

from supervisor.models.devices import DeviceReadError, DeviceSource, SystemSource

log = logging.getLogger("gpuvisor.engine")


class EngineBuild(msgspec.Struct):
    # GPUs the driver tools report, and GPU devices the engine build can use.
    machine_gpus: int = 0
    engine_gpus: list[str] = []
    checked: bool = False
    warning: str | None = None


async def _engine_gpus() -> list[str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker.probe", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return [str(g) for g in json.loads(out)["gpu_devices"]]


async def check_engine_build(source: DeviceSource | None = None) -> EngineBuild:
    source = SystemSource() if source is None else source
    try:
        machine = len(await asyncio.to_thread(source.read))
    except DeviceReadError as exc:  # a broken driver: its tool fails or hangs
        log.warning("cannot read the GPUs: %s", exc)
        return EngineBuild(checked=True)
    if machine == 0:
        return EngineBuild(checked=True)
    try:
        engine = await _engine_gpus()
    except (OSError, ValueError, KeyError, TimeoutError) as exc:
        return EngineBuild(machine, [], True, f"could not probe the engine build: {exc}")
    warning = None
    if not engine:
        warning = (f"the driver shows {machine} GPU(s) but the installed engine is its CPU build: "
                   "models run on the CPU; install the GPU build (README, 'GPU')")
        log.warning(warning)
    return EngineBuild(machine, engine, True, warning)


class EngineCheck:
    """Owns the start-up check's task; ``build`` is its result once done."""

    def __init__(self) -> None:
        self.build = EngineBuild()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-check")

    async def _run(self) -> None:
        self.build = await check_engine_build()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
