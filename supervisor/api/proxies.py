"""Clients and the proxies in front of us: who is calling, under which host
name, over how many connections.

- Trusted reverse proxies: behind nginx or Caddy the peer address is the
  proxy's; the real client is in ``X-Forwarded-For``. Those headers are
  believed only when the peer is one of the configured proxies (addresses or
  CIDRs); from anyone else they are ignored, so a client cannot forge its
  address into logs or generated URLs.
- Host names (DNS rebinding): a request must name loopback, the address it
  arrived on, the configured ``host`` or a ``trusted_hosts`` entry; else 421.
  Requests through a trusted proxy are exempt: the proxy picks the names it
  serves (and its TLS certificate binds them).
- Connections: aiohttp bounds neither the time a client takes to send its
  headers nor the connections one client holds. :class:`GuardedRunner`
  closes a connection whose request headers are not complete within
  ``header_timeout`` and refuses connections over ``max_connections_per_client``
  at once; idle keep-alive connections close after ``keepalive_timeout``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler

from supervisor.config import Config
from supervisor.errors import ApiError

log = logging.getLogger("gpuvisor.proxies")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Set on a request whose peer is a trusted proxy (before X-Forwarded-* apply).
VIA_PROXY: web.RequestKey[bool] = web.RequestKey("via_trusted_proxy", bool)
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})


class MisdirectedRequest(ApiError):
    status = 421
    type = "invalid_request_error"
    code = "untrusted_host"
    # Nothing on this connection is for us (RFC 9110: retry on a new one);
    # closing spares reading what is left of its body.
    close_connection = True


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


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback address (a host name may resolve to anything)."""
    if host == "localhost":
        return True
    addr = _ip(host)
    return addr is not None and addr.is_loopback


def client_key(remote: str) -> str:
    """What per-client limits count by: the address, or an IPv6 address's /64
    (one site's subnet: its hosts would otherwise each get a full quota)."""
    addr = _ip(remote)
    if isinstance(addr, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr) if addr is not None else remote


def host_name(header: str) -> str:
    """The name in a Host header: no port, no brackets, no trailing dot, lower case."""
    text = header.strip().lower()
    if text.startswith("["):
        end = text.find("]")
        return text[1:end] if end > 0 else ""
    if text.count(":") == 1:
        text = text.partition(":")[0]
    return text.rstrip(".")


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
            request[VIA_PROXY] = True  # the clone below copies it
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


# ---------------------------------------------------------------- host names


class HostAllowlist:
    """DNS rebinding defence: a page on an attacker's name that resolves to us
    sends that name as Host; only the names we answer to are served."""

    def __init__(self, names: Sequence[str], bind_host: str = "") -> None:
        self.exact: set[str] = set()
        self.suffixes: list[str] = []  # ".example.org" from "*.example.org"
        for entry in names:
            name = host_name(entry.removeprefix("*"))
            if entry.strip().startswith(("*.", ".")):
                self.suffixes.append("." + name.lstrip("."))
            elif name:
                self.exact.add(name)
        bind = host_name(bind_host)
        if bind not in _WILDCARD_BINDS:
            self.exact.add(bind)

    @classmethod
    def from_config(cls, cfg: Config) -> HostAllowlist:
        return cls(cfg.trusted_hosts, cfg.host)

    def allows(self, header: str, local: str | None = None) -> bool:
        """``header`` (a Host value) names us; ``local``: the address the
        connection arrived on (a wildcard bind answers on each of them)."""
        name = host_name(header)
        if not name:
            return False
        # *.localhost never leaves the machine (RFC 6761; browsers resolve it themselves).
        if name == "localhost" or name.endswith(".localhost") or name in self.exact:
            return True
        addr = _ip(name)
        if addr is not None and (addr.is_loopback or (local is not None and addr == _ip(local))):
            return True
        return any(name.endswith(suffix) for suffix in self.suffixes)

    def middleware(self) -> Middleware:
        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            header = request.headers.get("Host")
            # No Host header (HTTP/1.0): no browser sends that, so no rebinding.
            if header is None or request.get(VIA_PROXY):
                return await handler(request)
            if not self.allows(header, _local_address(request)):
                raise MisdirectedRequest(
                    f"this server does not answer to the host name {host_name(header)!r}; "
                    "add it to trusted_hosts if it is one of ours")
            return await handler(request)

        return middleware


def _local_address(request: web.BaseRequest) -> str | None:
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    return str(sockname[0]) if isinstance(sockname, tuple) and sockname else None


# ---------------------------------------------------------------- connections


class ConnectionGuard:
    """Counts open connections per client and holds the header deadline; the
    server's handlers (below) ask it when a connection opens and closes."""

    def __init__(self, header_timeout: float, per_client: int, proxies: TrustedProxies) -> None:
        self.header_timeout = header_timeout
        self.per_client = per_client
        self.proxies = proxies
        self._open: dict[str, int] = {}
        self._refusing: set[str] = set()  # logged once per stretch at the cap

    @classmethod
    def from_config(cls, cfg: Config) -> ConnectionGuard:
        return cls(cfg.header_timeout, cfg.max_connections_per_client, TrustedProxies.from_config(cfg))

    def _key(self, peer: str | None) -> str | None:
        # A proxy carries many clients' connections, and limits them itself.
        if peer is None or self.proxies.trusts(peer):
            return None
        return client_key(peer)

    def open_count(self, peer: str) -> int:
        key = self._key(peer)
        return 0 if key is None else self._open.get(key, 0)

    def admit(self, peer: str | None) -> bool:
        key = self._key(peer)
        if key is None:
            return True
        count = self._open.get(key, 0)
        if count >= self.per_client:
            if key not in self._refusing:
                self._refusing.add(key)
                log.warning("client %s holds %d connections (max_connections_per_client): "
                            "refusing more", key, count)
            return False
        self._open[key] = count + 1
        return True

    def release(self, peer: str | None) -> None:
        key = self._key(peer)
        if key is None:
            return
        count = self._open.get(key, 0) - 1
        if count > 0:
            self._open[key] = count
        else:
            self._open.pop(key, None)
        if count < self.per_client:
            self._refusing.discard(key)


class _GuardedHandler(RequestHandler):
    """aiohttp's connection handler, plus the guard's two rules.

    aiohttp's keep-alive timer runs from a connection's start and after each
    response, so it also bounds headers, but only at the long idle timeout.
    Here each request's headers get ``header_timeout`` from the connection's
    start (the first request) or from their first byte (later ones). This
    reads three attributes of aiohttp's handler (``_messages``,
    ``_request_in_progress``, ``_waiter``); tests/test_security_http.py pins
    the behaviour should they change.
    """

    __slots__ = ("_guard", "_peer", "_admitted", "_header_timer")

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._peer: str | None = None
        self._admitted = False
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) and peer else None
        if not self._guard.admit(self._peer):
            cast(asyncio.Transport, transport).abort()  # at once, no lingering close
            return
        self._admitted = True
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._messages or self._request_in_progress:
            self._disarm()  # headers complete, or bytes of a running request's body
        elif self._admitted and self._header_timer is None:
            self._arm()  # the first byte of the next request's headers

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._admitted:
            self._admitted = False
            self._guard.release(self._peer)
        super().connection_lost(exc)

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._header_timer = loop.call_later(self._guard.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        # Only while the handler waits for a request (as aiohttp's own
        # keep-alive close does): a running request is never cut.
        if self._waiter is not None and not self._waiter.done():
            self.force_close()


class _GuardedServer(web.Server):
    def __init__(self, handler: Any, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.guard = guard

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, guard=self.guard, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are handled under ``guard``."""

    __slots__ = ("guard",)

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.guard = guard

    async def _make_server(self) -> web.Server:
        # The app's own server (after its startup), rebuilt with our handler.
        plain = await super()._make_server()
        return _GuardedServer(plain.request_handler, guard=self.guard,
                              request_factory=plain.request_factory,
                              handler_cancellation=plain.handler_cancellation,
                              loop=asyncio.get_running_loop(), **plain._kwargs)
