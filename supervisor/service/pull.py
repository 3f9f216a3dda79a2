"""``gpuvisor pull REPO[@REV][:QUANT]``: a download job on the running service,
followed live with a progress bar until it ends. Ctrl-C cancels the job.
Success is the model id ``/v1/models`` lists, read back from the service
(supervisor/service/pull_listed.py)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

import aiohttp
import msgspec

from jobs.download_params import parse_pull_spec
from jobs.errors import FieldValueError
from supervisor.config import Config
from supervisor.models.hub_cache import OFF
from supervisor.service import key_advice, pull_listed


def add_subcommand(sub: Any) -> argparse.ArgumentParser:
    sp: argparse.ArgumentParser = sub.add_parser("pull", help="download a model from the Hugging Face Hub")
    sp.add_argument("spec", metavar="REPO[@REV][:QUANT]",
                    help="e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
    sp.add_argument("--url", help="service URL (default: from host/port in the config)")
    sp.add_argument("--token", help="admin token (default: GPUVISOR_TOKEN, then admin_token)")
    sp.add_argument("--wait", type=float, default=30.0, metavar="SECONDS",
                    help="how long to wait for the service to list the model (default: 30)")
    return sp


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def render_progress(data: dict[str, Any], width: int = 30) -> str:
    frac = float(data.get("progress", 0.0))
    filled = int(frac * width)
    line = f"[{'#' * filled}{'.' * (width - filled)}] {frac * 100:5.1f}%"
    if "bytes_total" in data:
        line += f"  {_mib(data.get('bytes_done', 0))} / {_mib(data['bytes_total'])}"
    if data.get("rate"):
        line += f"  {_mib(data['rate'])}/s"
    return line


async def _events(http: aiohttp.ClientSession, url: str) -> Any:
    """(event type, data) pairs from a job's SSE stream."""
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=None, sock_read=120)) as resp:
        resp.raise_for_status()
        kind, data = "message", ""
        async for raw in resp.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data += line[6:]
            elif not line and data:
                yield kind, json.loads(data)
                kind, data = "message", ""


def unreachable(url: str, exc: aiohttp.ClientError) -> str:
    """One line for a service that does not answer (status and pull say the same)."""
    refused = isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError)
    why = "connection refused" if refused else str(exc) or type(exc).__name__
    return (f"gpuvisor is not reachable at {url} ({why}): is it running? "
            "Start it with `gpuvisor serve`, or pass the --port or --url it listens on")


async def pull(args: argparse.Namespace, cfg: Config, url: str, cred: key_advice.Credential,
               out: TextIO = sys.stderr) -> int:
    try:
        params = msgspec.to_builtins(parse_pull_spec(args.spec))
    except FieldValueError as exc:
        # Refused here, before anything is queued (the service refuses it the same way).
        print(f"gpuvisor: {args.spec!r} is not REPO[@REV][:QUANT]: {exc}", file=out)
        return 2
    async with aiohttp.ClientSession(headers=cred.headers) as http:
        try:
            async with http.post(url + "/api/jobs", json={"kind": "download", "params": params}) as resp:
                body = await resp.json()
        except aiohttp.ClientConnectionError as exc:
            print(unreachable(url, exc), file=out)
            return 1
        if resp.status >= 400:
            print(f"gpuvisor: {body['error']['message']}", file=out)
            for line in key_advice.refused(resp.status, cred, cfg):
                print(line, file=out)
            return 1
        job_id = body["id"]
        print(f"pulling {args.spec} (job {job_id})", file=out)
        try:
            # A Hub the service could not reach: the job's error is the advice (jobs/hub_advice.py).
            result = await _follow(http, f"{url}/api/jobs/{job_id}/events", out)
        except (KeyboardInterrupt, aiohttp.ClientError) as exc:
            await http.post(f"{url}/api/jobs/{job_id}/cancel")
            print(f"\ncancelled ({type(exc).__name__})", file=out)
            return 130
        if result is None:
            return 1
        try:
            verdict = await pull_listed.check(http, url, result, args.wait,
                                              scan_off=cfg.hf_cache_dir.strip().lower() == OFF)
        except aiohttp.ClientError as exc:
            print(f"gpuvisor: the download is done, but the model list could not be read: {exc}", file=out)
            return 1
        for line in verdict.lines:
            print(line, file=out)
        return verdict.code


async def _follow(http: aiohttp.ClientSession, url: str, out: TextIO) -> dict[str, Any] | None:
    """Render the job's events until it ends: its result, or None when it did not succeed."""
    async for kind, event in _events(http, url):
        if kind == "progress":
            print("\r" + render_progress(event.get("data", {})), end="", file=out, flush=True)
        elif kind == "stage":
            print(f"\n{event.get('data', {}).get('stage', '')}", file=out)
        elif kind == "end":
            print("", file=out)
            if event["status"] == "succeeded":
                return dict(event.get("result") or {})
            print(f"{event['status']}: {event.get('error') or ''}", file=out)
            return None
    print("gpuvisor: the event stream ended before the job did", file=out)
    return None
