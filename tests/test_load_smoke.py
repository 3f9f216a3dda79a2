"""The load benchmark, briefly: concurrent clients against a real server end
with successes or sheds, never with transport errors, and leak no fds."""

from __future__ import annotations

import pytest

from bench import load


@pytest.mark.timeout(180)
def test_load_smoke() -> None:
    result = load.main(["--smoke", "--clients", "100"])
    assert len(result["rounds"]) == 2
    for r in result["rounds"]:
        # Every request ended with a success or a shed at the queue bound.
        assert not r["other_errors"], r["other_errors"]
        for kind in ("chat", "responses", "job"):
            assert r["ok"].get(kind, 0) > 0, (kind, r)
        assert r["ttft_p50_ms"] is not None
    # Open fds come back to where they were (connections, pipes, sockets).
    assert result["fd_growth"] <= 4, result
    assert result["rss_growth_mib"] < 32, result
