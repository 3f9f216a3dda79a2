"""``python -m worker``: load one model and serve it to the parent over IPC.

``--engine`` names the engine (worker/engine_api.py: ``ENGINES``); its module
is imported only once the worker has connected, so this entry point imports
no engine of its own. Exit codes are part of the contract: 0 = asked to stop
(or parent gone), 3 = the model cannot be loaded, also by an unknown or
uninstalled engine (do not restart), anything else = crash. The first line
of stdin is the secret of this spawn (worker/protocol.py: the handshake);
the rest of stdin is only watched for its end.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import sys
import tempfile
from pathlib import Path

from worker import speculative
from worker.engine_api import DEFAULT_ENGINE, ENGINES, EngineOptions
from worker.dial import Dial
from worker.protocol import RopeOptions
from worker.server import run


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m worker")
    dial = ap.add_mutually_exclusive_group(required=True)
    dial.add_argument("--socket", help="parent's Unix socket to connect to")
    dial.add_argument("--tcp", type=_host_port, help="parent's TCP listener to connect to, HOST:PORT")
    ap.add_argument("--model", required=True)
    # Not argparse choices: an unknown engine is a load failure (exit 3,
    # reported to the parent), not a usage error the parent would restart.
    ap.add_argument("--engine", default=DEFAULT_ENGINE,
                    help=f"the inference engine: {', '.join(sorted(ENGINES))} (default {DEFAULT_ENGINE})")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-gpu-layers", type=int, default=-1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--embedding", action="store_true")
    ap.add_argument("--cache-type", default="f16", choices=["f16", "q8_0", "q4_0"])
    speculative.add_arguments(ap)
    ap.add_argument("--parallel", type=int, default=1, help="generations at once (engine slots)")
    ap.add_argument("--engine-socket", default="",
                    help="Unix socket (ending in .sock) for the engine's own HTTP listener; "
                         "default: beside --socket, or in the temp dir with --tcp")
    ap.add_argument("--mmproj", default="", help="the model's image projector (mmproj GGUF)")
    ap.add_argument("--lora", action="append", default=[],
                    help="a GGUF LoRA adapter to hold for requests that name it (repeatable)")
    ap.add_argument("--tensor-split", type=_shares, default=(),
                    help="comma-separated shares of the layers per visible GPU, e.g. 0.6,0.4")
    ap.add_argument("--chat-template-file", default="",
                    help="a Jinja chat template to prompt with instead of the model's own")
    ap.add_argument("--rope-freq-scale", type=float, default=0.0,
                    help="YaRN: the engine's rope_freq_scale (with --yarn-orig-ctx); 0 = the model's own")
    ap.add_argument("--yarn-orig-ctx", type=int, default=0, help="YaRN: the context it scales from")
    ap.add_argument("--heartbeat", type=float, default=1.0)
    return ap.parse_args(argv)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}")
    return host.strip("[]"), int(port)


def _shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(x) for x in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from exc
    if any(x < 0 for x in shares) or sum(shares) <= 0:
        raise argparse.ArgumentTypeError(f"shares must be >= 0 and not all 0: {text!r}")
    return shares


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # stderr is the worker's log file; one line per request, with its id.
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.socket:
        dial = Dial(unix=args.socket)
        engine_socket = args.engine_socket or str(Path(args.socket).with_suffix(".e.sock"))
    else:
        dial = Dial(tcp=args.tcp)
        engine_socket = args.engine_socket or str(Path(tempfile.gettempdir()) / f"gpuvisor-w{os.getpid()}.e.sock")
    faulthandler.enable()  # a native crash leaves its Python stack in the log
    opts = EngineOptions(args.model, args.n_ctx, args.n_gpu_layers, args.threads, args.embedding,
                         args.cache_type, speculative.from_args(args), args.parallel, engine_socket,
                         args.mmproj)
    opts.lora = list(args.lora)
    opts.tensor_split = args.tensor_split
    opts.chat_template_file = args.chat_template_file
    opts.rope = RopeOptions(args.rope_freq_scale, args.yarn_orig_ctx)
    return asyncio.run(run(opts, dial, args.heartbeat, args.engine))


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown: the engine's destructor can wait
    # forever for a server loop that never started serving (seen with
    # xllamacpp 2026.10), and the OS frees its memory anyway.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
