"""Reads see committed rows only: they run on their own read-only connection."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.errors import NotFound
from tests.jobsupport import open_store


class Boom(Exception):
    pass


async def test_a_write_in_progress_or_rolled_back_is_never_read(tmp_path: Path) -> None:
    async with open_store(tmp_path / "gv.db") as store:
        job, _ = await store.submit("sleep", {"steps": 1})
        with pytest.raises(Boom):
            async with store.db.write() as conn:
                await conn.execute("UPDATE jobs SET status = 'failed', error = 'nothing was saved' WHERE id = ?",
                                   (job.id,))
                # Inside the writer's transaction: a reader sees the committed row.
                seen = await store.get(job.id)
                assert seen.status == "queued" and seen.error is None
                await conn.execute("DELETE FROM jobs WHERE id = ?", (job.id,))
                assert (await store.get(job.id)).status == "queued"
                raise Boom  # rolled back
        assert (await store.get(job.id)).status == "queued"
        async with store.db.write() as conn:
            await conn.execute("DELETE FROM jobs WHERE id = ?", (job.id,))
        with pytest.raises(NotFound):
            await store.get(job.id)  # a commit is seen at once


async def test_the_read_connection_cannot_write(tmp_path: Path) -> None:
    import sqlite3

    async with open_store(tmp_path / "gv.db") as store:
        with pytest.raises(sqlite3.OperationalError):
            await store.db.reader.execute("DELETE FROM jobs")
