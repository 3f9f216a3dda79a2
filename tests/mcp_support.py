"""Starts the tests' MCP server (tests/mcp_server.py) in a process of its own."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tests.server import REPO


@contextmanager
def mcp_server(sse: bool = False) -> Iterator[str]:
    """The URL of a running test MCP server: streamable HTTP at /mcp, or
    HTTP+SSE at /sse; the process ends with the block."""
    args = [sys.executable, "-m", "tests.mcp_server", *(["--sse"] if sse else [])]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("port "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}/{'sse' if sse else 'mcp'}"
    finally:
        proc.kill()
        proc.wait()
