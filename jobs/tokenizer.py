"""A model's own tokenizer in a job process, through the engine's ``/tokenize``.

The engine (xllamacpp) has no vocab-only mode, so the model is loaded the way
that costs least: on the CPU, with the smallest context, no warmup and no
repacked weight copies. Its weights are only memory-mapped (file pages the
kernel may drop again), never copied or computed with, so the job's own
memory stays small whatever the model's size; the file is still read once.
Tokens come from the same ``/tokenize`` endpoint a worker serves, so a count
here is the count the worker's tokenizer gives for the same text.

The engine's HTTP listener is bound to a Unix socket in a private (0700)
temp dir, never to TCP, and the dir is removed when the tokenizer closes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jobs.context import JobError
from worker.unix_http import UnixJSONClient

# Linux sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
_SOCKET_NAME = "e.sock"
# llama.cpp rounds a context up to 256 tokens; tokenizing never uses it.
_N_CTX = 256
# Errors only: the job's log gets load failures, not per-request noise.
_VERBOSITY = 1


class Tokenizer:
    """Tokenizes text with the loaded model's vocabulary."""

    def __init__(self, client: UnixJSONClient) -> None:
        self._client = client

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``; by default as plain content (no BOS/EOS,
        special-token text such as ``<|im_end|>`` tokenized literally)."""
        return self._client.tokenize(text, add_special=add_special, parse_special=parse_special)

    def count(self, text: str) -> int:
        return len(self.tokenize(text))


def _engine_params(model_path: str, sock: Path) -> Any:
    import xllamacpp  # heavy native module: only in the job process

    p = xllamacpp.CommonParams()
    p.model.path = model_path
    p.n_ctx = _N_CTX
    p.n_parallel = 1
    p.n_gpu_layers = 0
    p.cpuparams.n_threads = 1
    p.cpuparams_batch.n_threads = 1
    # One keep-alive connection at a time, plus one spare for a reconnect.
    p.n_threads_http = 2
    p.warmup = False
    # Fitting to device memory would load the model a second time.
    p.fit_params = False
    # Keep everything off an accelerator: tokenizing never computes.
    p.no_kv_offload = True
    p.no_op_offload = True
    # No repacked copies of quantized weights in anonymous memory.
    p.no_extra_bufts = True
    p.verbosity = _VERBOSITY
    p.hostnames = [str(sock)]
    return p


def socket_path(sock_dir: Path) -> Path:
    sock = sock_dir / _SOCKET_NAME
    if len(os.fsencode(sock)) > MAX_SOCKET_PATH:
        raise JobError(f"socket path {sock} is longer than {MAX_SOCKET_PATH} bytes; "
                       "use a shorter temp dir")
    return sock


@contextmanager
def open_tokenizer(model_path: str, socket_parent: Path) -> Iterator[Tokenizer]:
    """Load ``model_path`` for tokenizing; the engine listens on a socket in a
    new private dir under ``socket_parent`` (keep it short: Unix socket
    paths are limited to about 100 bytes)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="gvtok-", dir=socket_parent))
    try:
        sock = socket_path(sock_dir)
        # A stale socket file would make the engine's bind fail.
        sock.unlink(missing_ok=True)
        with _serving(model_path, sock):
            yield Tokenizer(UnixJSONClient(sock))
    finally:
        shutil.rmtree(sock_dir)


@contextmanager
def _serving(model_path: str, sock: Path) -> Iterator[None]:
    import xllamacpp

    try:
        server = xllamacpp.Server(_engine_params(model_path, sock))
    except RuntimeError as exc:
        # The exception only says that it failed; the engine logged its
        # reason to stderr, which is the job's log.
        raise JobError(f"could not load {Path(model_path).name} to count tokens "
                       "(the job log has the engine's reason)") from exc
    try:
        yield
    finally:
        # A Server dropped right after it was made can hang in its destructor
        # (about 1 in 3 in a load-and-drop test, which is what a dataset with
        # nothing to count does); letting its loop thread run first avoided
        # it in every trial.
        time.sleep(0.05)
        # The engine stops when its last reference goes: drop ours now, not
        # whenever a traceback holding this frame is collected.
        del server
