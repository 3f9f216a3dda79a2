"""``gpuvisor pull REPO[@REV][:QUANT]``: a download job on the running service,
followed live with a progress bar until it ends. Ctrl-C cancels the job."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import aiohttp
import msgspec

from jobs.download_params import parse_pull_spec
from supervisor.config import Config

DEFAULT_HUB = "https://huggingface.co"
# How a job's error reads when the Hub could not be reached at all (httpx's
# connect errors and timeouts, DNS and routing failures, huggingface_hub's own).
_UNREACHABLE_MARKS = ("ConnectError", "ConnectTimeout", "ReadTimeout", "ConnectionError", "Timeout",
                      "Name or service not known", "Temporary failure in name resolution",
                      "Network is unreachable", "No route to host", "LocalEntryNotFoundError",
                      "OfflineModeIsEnabled")


def add_subcommand(sub: Any) -> argparse.ArgumentParser:
    sp: argparse.ArgumentParser = sub.add_parser("pull", help="download a model from the Hugging Face Hub")
    sp.add_argument("spec", metavar="REPO[@REV][:QUANT]",
                    help="e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
    sp.add_argument("--url", help="service URL (default: from host/port in the config)")
    sp.add_argument("--token", help="admin token (default: GPUVISOR_TOKEN, then admin_token)")
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


def hub_unreachable_help(cfg: Config, environ: Mapping[str, str] = os.environ) -> list[str]:
    """What to do when the service cannot reach the Hub: it names the endpoint tried."""
    endpoint = environ.get("HF_ENDPOINT") or DEFAULT_HUB
    where = "" if environ.get("HF_ENDPOINT") else " (unless the service's environment sets HF_ENDPOINT)"
    cache = cfg.hf_cache_dir or "~/.cache/huggingface/hub"
    return [
        f"the service could not reach the Hugging Face Hub at {endpoint}{where}. Instead:",
        f"  - copy a .gguf file into the models directory ({cfg.models_dir}); it is listed within seconds",
        "  - set HF_ENDPOINT in the service's environment to a Hub mirror it can reach, and pull again",
        (f"  - use the Hugging Face cache: with hf_cache_dir = \"{cache}\" in the config the models in it "
         "are listed, and HF_HUB_OFFLINE=1 in the service's environment makes a pull use only the cache"),
    ]


async def pull(args: argparse.Namespace, cfg: Config, url: str, headers: dict[str, str],
               out: TextIO = sys.stderr) -> int:
    params = msgspec.to_builtins(parse_pull_spec(args.spec))
    async with aiohttp.ClientSession(headers=headers) as http:
        try:
            async with http.post(url + "/api/jobs", json={"kind": "download", "params": params}) as resp:
                body = await resp.json()
        except aiohttp.ClientConnectionError as exc:
            print(unreachable(url, exc), file=out)
            return 1
        if resp.status >= 400:
            print(f"gpuvisor: {body['error']['message']}", file=out)
            return 1
        job_id = body["id"]
        print(f"pulling {args.spec} (job {job_id})", file=out)
        try:
            code, error = await _follow(http, f"{url}/api/jobs/{job_id}/events", out)
            if error and any(mark in error for mark in _UNREACHABLE_MARKS):
                print("\n".join(hub_unreachable_help(cfg)), file=out)
            return code
        except (KeyboardInterrupt, aiohttp.ClientError) as exc:
            await http.post(f"{url}/api/jobs/{job_id}/cancel")
            print(f"\ncancelled ({type(exc).__name__})", file=out)
            return 130


async def _follow(http: aiohttp.ClientSession, url: str, out: TextIO) -> tuple[int, str]:
    """Render the job's events until it ends: (exit code, the job's error)."""
    async for kind, event in _events(http, url):
        if kind == "progress":
            print("\r" + render_progress(event.get("data", {})), end="", file=out, flush=True)
        elif kind == "stage":
            print(f"\n{event.get('data', {}).get('stage', '')}", file=out)
        elif kind == "end":
            print("", file=out)
            if event["status"] == "succeeded":
                result = event.get("result") or {}
                print(f"done: model {result.get('model_id', '?')} is in the library", file=out)
                return 0, ""
            error = str(event.get("error") or "")
            print(f"{event['status']}: {error}", file=out)
            return 1, error
    return 1, "the event stream ended before the job did"
