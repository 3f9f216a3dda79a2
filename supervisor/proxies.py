"""Trusted reverse proxies: X-Forwarded-For/-Proto/-Host, only from them.

Behind nginx or Caddy the peer address is the proxy's; the real client is in
``X-Forwarded-For``. Those headers are believed only when the peer is one of
the configured proxies (addresses or CIDRs); from anyone else they are
ignored, so a client cannot forge its address into logs or generated URLs.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

from supervisor.config import Config

log = logging.getLogger("gpuvisor.proxies")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def parse_networks(entries: Sequence[str]) -> list[Network]:
    """``["127.0.0.1", "10.0.0.0/8", "::1"]``; raises ValueError naming the entry."""
    nets: list[Network] = []
    for entry in entries:
        try:
            nets.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"trusted_proxies: {entry!r} is not an address or CIDR") from exc
    return nets


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # "[::1]:1234"
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # "1.2.3.4:1234"
        text = text.split(":")[0]
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


class TrustedProxies:
    def __init__(self, networks: Sequence[Network]) -> None:
        self.networks = list(networks)

    @classmethod
    def from_config(cls, cfg: Config) -> TrustedProxies:
        return cls(parse_networks(cfg.trusted_proxies))

    def trusts(self, remote: str | None) -> bool:
        addr = _ip(remote) if remote else None
        return addr is not None and any(addr in net for net in self.networks)

    def client(self, remote: str, forwarded_for: str) -> str:
        """Walk X-Forwarded-For from the right past our own proxies: the first
        untrusted hop is the client (left entries could be forged by it)."""
        hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
        client = remote
        for hop in reversed(hops):
            addr = _ip(hop)
            if addr is None:
                break
            client = str(addr)
            if not any(addr in net for net in self.networks):
                break
        return client

    def middleware(self) -> Middleware:
        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not self.networks or not self.trusts(request.remote):
                return await handler(request)
            headers = request.headers
            changes: dict[str, str] = {}
            if "X-Forwarded-For" in headers:
                changes["remote"] = self.client(request.remote or "", headers["X-Forwarded-For"])
            proto = headers.get("X-Forwarded-Proto", "").split(",")[-1].strip().lower()
            if proto in ("http", "https"):
                changes["scheme"] = proto
            host = headers.get("X-Forwarded-Host", "").split(",")[-1].strip()
            if host:
                changes["host"] = host
            if not changes:
                return await handler(request)
            return await handler(request.clone(**changes))  # type: ignore[arg-type]

        return middleware
