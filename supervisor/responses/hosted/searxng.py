"""Searching through a SearXNG instance's JSON API (``GET <url>?q=...&format=json``).

The admin names the search endpoint (``web_search_searxng_url``); it obeys
the address rules of MCP servers (:mod:`.addresses`): an http(s) URL with no
credentials, never a link-local or cloud-metadata address, checked before
the request and again by the resolver the connection uses, so a name that
resolves differently on the second lookup is refused too. No redirect is
followed. The answer is bounded in time (``timeout_s``) and size
(``MAX_BODY_BYTES``), and each result in length; only http(s) result URLs
are kept.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from supervisor.responses.hosted.addresses import AddressRefused, check_address, refused_ip

# SearXNG's answer for one page of results is tens of KiB: a MiB is ample.
MAX_BODY_BYTES = 1 << 20
MAX_TITLE = 200
MAX_SNIPPET = 600
MAX_URL = 2048
# A query past this is cut: no search engine reads further, and it bounds the request line.
MAX_QUERY = 1000


class SearchFailed(Exception):
    """The provider could not be reached or gave no usable answer; the
    message is for the log (it may name the provider's address)."""


@dataclass(frozen=True)
class Hit:
    url: str
    title: str
    snippet: str


def provider_problem(url: str) -> str | None:
    """Why ``url`` cannot be the search endpoint (None: it can, as text)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        return f"{url!r} is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http or https URL"
    if parts.username or parts.password:
        return "the search URL may not carry credentials"
    return None


class _CheckedResolver(AbstractResolver):
    """The default resolver, refusing a name with a link-local or metadata address."""

    def __init__(self) -> None:
        self._inner = ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        for entry in found:
            ip = ipaddress.ip_address(str(entry["host"]).split("%")[0])
            if refused_ip(ip):
                raise OSError(f"{host!r} resolves to {ip}, a link-local or metadata address")
        return found

    async def close(self) -> None:
        await self._inner.close()


def _clip(value: Any, limit: int) -> str:
    return " ".join(value.split())[:limit] if isinstance(value, str) else ""


def _hits(body: bytes) -> list[Hit]:
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise SearchFailed(f"the answer is not JSON ({exc})") from exc
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list):
        raise SearchFailed("the answer has no results list (is format=json enabled in its settings.yml?)")
    hits = []
    for entry in results:
        if not isinstance(entry, dict):
            continue
        url = entry.get("url")
        if not isinstance(url, str) or len(url) > MAX_URL or urlsplit(url).scheme not in ("http", "https"):
            continue
        hits.append(Hit(url, _clip(entry.get("title"), MAX_TITLE), _clip(entry.get("content"), MAX_SNIPPET)))
    return hits


async def _body(response: aiohttp.ClientResponse) -> bytes:
    data = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise SearchFailed(f"the answer is over {MAX_BODY_BYTES} bytes")
    return bytes(data)


async def search(url: str, query: str, timeout_s: float) -> list[Hit]:
    """The provider's results for ``query``, in its order. Raises SearchFailed."""
    problem = provider_problem(url)
    if problem is not None:
        raise SearchFailed(problem)
    try:
        await check_address(url)
    except AddressRefused as exc:
        raise SearchFailed(str(exc)) from exc
    connector = aiohttp.TCPConnector(resolver=_CheckedResolver(), limit=1)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        # trust_env off: the service's proxy settings are not the provider's way.
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
            async with session.get(url, params={"q": query[:MAX_QUERY], "format": "json"}, allow_redirects=False,
                                   headers={"Accept": "application/json"}) as response:
                if response.status != 200:
                    raise SearchFailed(f"the provider answered HTTP {response.status}")
                return _hits(await _body(response))
    except TimeoutError as exc:
        raise SearchFailed(f"no answer within {timeout_s:g} s") from exc
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        # ValueError: a query that cannot be encoded (a lone surrogate a model wrote).
        raise SearchFailed(f"{type(exc).__name__}: {exc}") from exc
