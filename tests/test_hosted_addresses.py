"""The address rules of hosted MCP tools, without a network."""

from __future__ import annotations

import ipaddress

import pytest

from supervisor.responses.hosted.addresses import AddressRefused, check_address, matches, refused_ip, url_problem

ALLOWED = ("https://tools.example.org/mcp", "http://127.0.0.1:8080")


@pytest.mark.parametrize("url,ok", [
    ("https://tools.example.org/mcp", True),
    ("https://tools.example.org/mcp/sub", True),
    ("https://tools.example.org/mcpx", False),
    ("https://tools.example.org.evil.net/mcp", False),
    ("http://tools.example.org/mcp", False),
    ("https://tools.example.org:444/mcp", False),
    ("http://127.0.0.1:8080/anything", True),
    ("http://127.0.0.1:8081/anything", False),
])
def test_allowlist_prefixes_match_whole_origins(url: str, ok: bool) -> None:
    assert any(matches(url, entry) for entry in ALLOWED) is ok


def test_bad_urls_say_why() -> None:
    assert "credentials" in (url_problem("https://u:p@tools.example.org/mcp", ALLOWED) or "")
    assert "http or https" in (url_problem("file:///etc/passwd", ALLOWED) or "")
    assert url_problem("https://tools.example.org/mcp", ALLOWED) is None


@pytest.mark.parametrize("ip", ["169.254.169.254", "fe80::1", "fd00:ec2::254", "::ffff:169.254.169.254",
                                "0.0.0.0", "224.0.0.1"])
def test_link_local_and_metadata_addresses_are_refused(ip: str) -> None:
    assert refused_ip(ipaddress.ip_address(ip))


async def test_a_literal_metadata_address_is_refused() -> None:
    with pytest.raises(AddressRefused):
        await check_address("http://169.254.169.254/latest")
    await check_address("http://127.0.0.1:8080/mcp")  # loopback is for the allowlist to decide
