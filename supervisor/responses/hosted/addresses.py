"""Which MCP server URLs may be reached: the admin's allowlist, and never a
link-local or cloud-metadata address, whatever the allowlist says.

An allowlist entry is a URL prefix: scheme, host and port must be equal,
and the path must be the entry's path or below it (``/mcp`` allows
``/mcp`` and ``/mcp/x``, not ``/mcpx``). Every request the MCP client makes
is checked again (:func:`request_allowed`), so a redirect the SDK follows
cannot leave the allowlist either.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import SplitResult, urlsplit

from supervisor.errors import BadRequest

# Cloud metadata services outside 169.254.0.0/16 (AWS IPv6, Alibaba).
_METADATA = frozenset({ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")})
_DEFAULT_PORTS = {"http": 80, "https": 443}


class AddressRefused(Exception):
    """A URL the MCP client must not reach; the message says why."""


def _port(parts: SplitResult) -> int:
    return parts.port or _DEFAULT_PORTS.get(parts.scheme, 0)


def _under(path: str, prefix: str) -> bool:
    base = prefix.rstrip("/")
    return not base or path == base or path.startswith(base + "/")


def matches(url: str, entry: str) -> bool:
    """Whether ``url`` lies under the allowlist ``entry``."""
    u, e = urlsplit(url), urlsplit(entry)
    return (u.scheme == e.scheme and (u.hostname or "") == (e.hostname or "") and _port(u) == _port(e)
            and _under(u.path or "/", e.path))


def url_problem(url: str, allowed: tuple[str, ...]) -> str | None:
    """Why ``url`` may not be used (None: it may, as far as its text goes)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        return f"{url!r} is not a valid URL ({exc})"
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        return f"{url!r} is not an http or https URL"
    if parts.username or parts.password:
        return "a server_url may not carry credentials; send them in headers or authorization"
    if any(seg in (".", "..") for seg in parts.path.split("/")) or "%2e" in parts.path.lower():
        return f"{url!r} has dot segments in its path"
    if not any(matches(url, entry) for entry in allowed):
        return f"{url!r} is not in this server's MCP allowlist (the mcp_allowed_urls setting)"
    return None


def refused_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return refused_ip(ip.ipv4_mapped)
    return ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip in _METADATA


async def check_address(url: str) -> None:
    """Resolve the URL's host; raise AddressRefused if any address it names
    is link-local, multicast, unspecified or a metadata service. (A name
    that resolves differently on the next lookup is not caught here; the
    allowlist is what bounds which hosts are asked at all.)"""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, _port(parts), type=socket.SOCK_STREAM)
    except OSError as exc:
        raise AddressRefused(f"cannot resolve {host!r}: {exc}") from exc
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if refused_ip(ip):
            raise AddressRefused(f"{host!r} resolves to {ip}, a link-local or metadata address")


def request_allowed(url: str, allowed: tuple[str, ...]) -> None:
    """Raise AddressRefused for a request URL outside the allowlist."""
    problem = url_problem(url, allowed)
    if problem is not None:
        raise AddressRefused(problem)


async def checked_server_url(url: str, allowed: tuple[str, ...], param: str) -> None:
    """The request-time check of one mcp tool's server_url: a 400 naming ``param``."""
    problem = url_problem(url, allowed)
    if problem is None:
        try:
            await check_address(url)
        except AddressRefused as exc:
            problem = str(exc)
    if problem is not None:
        raise BadRequest(f"mcp tool {param.split('.')[0]}: {problem}", param=param, code="mcp_url_refused")
