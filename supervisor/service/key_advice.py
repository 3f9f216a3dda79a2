"""What the CLI says about authentication: which token a command sends, what
``keys add`` and ``keys revoke`` changed for the running service, and how to
pass a token when the service refuses one.

A first key switches authentication on for good (``auth = "auto"``), so the
command that adds it says so, with the way in for clients and for the UI.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from supervisor.config import Config
from supervisor.service.state_lock import Holder

HOW_TO_PASS = "pass an API key or the admin token with --token TOKEN or GPUVISOR_TOKEN=TOKEN"
MAKE_ONE = "`gpuvisor keys add NAME` makes an API key, `gpuvisor keys admin-token` an admin token"


@dataclass(frozen=True)
class Credential:
    """The token a command sends, and where it came from (for the advice)."""

    token: str
    source: str  # "--token", "GPUVISOR_TOKEN", "admin_token", or "" when none is sent

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


def credential(args: argparse.Namespace, cfg: Config) -> Credential:
    """``--token``, else ``GPUVISOR_TOKEN``, else a plain ``admin_token`` (a hash cannot be sent)."""
    if args.token:
        return Credential(args.token, "--token")
    if os.environ.get("GPUVISOR_TOKEN"):
        return Credential(os.environ["GPUVISOR_TOKEN"], "GPUVISOR_TOKEN")
    if cfg.admin_token and not cfg.admin_token.startswith("scrypt$"):
        return Credential(cfg.admin_token, "admin_token")
    return Credential("", "")


def refused(status: int, cred: Credential, cfg: Config) -> list[str]:
    """Lines after a 401 or 403 from the service: how to pass a token."""
    if status == 403:
        return [f"  the token from {cred.source or 'the request'} is valid but this needs the admin token: "
                "pass it with --token TOKEN or GPUVISOR_TOKEN=TOKEN"]
    if status != 401:
        return []
    if cred.source:
        sent = f"the token from {cred.source} was not accepted"
    elif cfg.admin_token.startswith("scrypt$"):
        sent = "no token was sent (admin_token in the config is a hash: pass the token itself)"
    else:
        sent = "no token was sent"
    return [f"  authentication is on and {sent}: {HOW_TO_PASS}", f"  ({MAKE_ONE})"]


def after_add(key_name: str, *, was_on: bool, service: Holder | None, cfg: Config,
              config_url: str) -> list[str]:
    """What adding a key did, printed after the key (on stderr: stdout is the key alone)."""
    if cfg.auth == "off":
        return ['# auth = "off" is set: the service checks no key until that line goes (then restart it).']
    url = (service.url if service is not None else None) or config_url
    if was_on:
        lines = ["# Authentication was already on."]
    elif service is not None:
        lines = [f"# Authentication is now ON for the gpuvisor running on this state dir (pid {service.pid}, "
                 f"{url}):", "#   within a second, /v1/*, /api/* and the lab UI need a credential."]
    else:
        lines = ["# Authentication is on from the next start of gpuvisor on this state dir:",
                 "#   /v1/*, /api/* and the lab UI will need a credential."]
    lines.append("# Clients send this key as the header  Authorization: Bearer <key>  (OpenAI SDKs: api_key=<key>).")
    if cfg.admin_token:
        lines.append(f"# The lab UI and /api/* changes take the admin token (admin_token is set): sign in at "
                     f"{url}/login, or send it as Authorization: Bearer <token>.")
    else:
        lines += [
            "# No admin token is configured, so this key also has admin rights on /api/*.",
            "# The lab UI signs in with an admin token: `gpuvisor keys admin-token` makes one (it prints the",
            "#   token, and the admin_token line for the config; or set GPUVISOR_ADMIN_TOKEN=<token>);",
            f"#   restart the service, then sign in at {url}/login with it.",
        ]
    lines += ["# Read the service with: gpuvisor status --token <key> (or GPUVISOR_TOKEN=<key>).",
              f"# To undo: gpuvisor keys revoke {key_name}, then auth = \"off\" in the config "
              "(the README's Configuration section)."]
    return lines


def after_revoke(any_left: bool, cfg: Config) -> list[str]:
    """What revoking did: the last key gone leaves authentication on (nobody gets in)."""
    if any_left or cfg.auth == "off" or cfg.admin_token or cfg.api_keys:
        return []
    return ["# That was the last key: authentication stays on, and protected routes answer 401 until a key",
            "#   is added (gpuvisor keys add NAME). To serve without authentication, set auth = \"off\" in the",
            "#   config (GPUVISOR_AUTH=off) and restart."]
