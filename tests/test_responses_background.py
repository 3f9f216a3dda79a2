"""Background responses that were accepted wait their turn; none is dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from tests.server import Server, short_tempdir

pytestmark = pytest.mark.timeout(240)


def test_two_hundred_background_responses_all_complete(tiny_model_path: Path,
                                                        start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    # A worker queue far smaller than the burst: before, 135 of 200 failed with queue_full.
    srv = start_server(models, env={"GPUVISOR_QUEUE_LIMIT": "8"})

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            created = await asyncio.gather(*(client.responses.create(
                model=srv.model, input=f"n{i}", background=True, max_output_tokens=4) for i in range(200)))
            assert {r.status for r in created} <= {"queued", "in_progress"}
            ids = [r.id for r in created]
            while True:
                statuses = [(await client.responses.retrieve(i)).status for i in ids]
                if all(s in ("completed", "incomplete", "failed", "cancelled") for s in statuses):
                    return statuses
                await asyncio.sleep(0.2)
        finally:
            await client.close()

    statuses = asyncio.run(run())
    assert statuses.count("failed") == 0, statuses
    assert set(statuses) <= {"completed", "incomplete"}
