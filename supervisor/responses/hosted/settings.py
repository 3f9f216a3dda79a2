"""The limits, allowlist and providers of the hosted-tool loop, from the configuration."""

from __future__ import annotations

from dataclasses import dataclass

# Studio's limits, which the loop's defaults follow.
DEFAULT_MAX_ITERATIONS = 25
DEFAULT_CALL_TIMEOUT_S = 300.0
DEFAULT_TOTAL_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class HostedSettings:
    # URL prefixes an MCP server_url must start with; empty: mcp is off.
    mcp_allowed_urls: tuple[str, ...] = ()
    # Generations that may end in tool calls; then the model must answer.
    max_iterations: int = DEFAULT_MAX_ITERATIONS
    # Seconds one tool call (listing a server's tools, too) may take.
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    # Seconds the calls of one response may take together.
    total_timeout_s: float = DEFAULT_TOTAL_TIMEOUT_S
    # A call repeating an earlier one (same server, tool, arguments) gets the
    # earlier result back instead of running again.
    suppress_duplicates: bool = True
    # web_search: the SearXNG search endpoint ("": off), the results one
    # search hands the model at most, and the seconds one search may take.
    web_search_url: str = ""
    web_search_max_results: int = 8
    web_search_timeout_s: float = 10.0

    @property
    def mcp_enabled(self) -> bool:
        return bool(self.mcp_allowed_urls)
