"""The memory fit's share for drafting against what the engine allocates.

The engine builds a context of its own for a draft model (and for MTP, one
for the NextN layers), with a KV cache and a compute buffer each; it logs
their sizes. Loaded in a subprocess with the worker's own engine settings,
the drafting context's KV cache must be what ``draft_bytes`` counts (to the
two decimals of MiB the engine prints), and ``draft_bytes`` must cover the
cache plus the engine's largest compute buffer.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from supervisor.models.demo import write_tiny_gguf
from supervisor.models.draft import SpeculativePlan, draft_bytes
from supervisor.models.gguf_info import read_gguf_info
from supervisor.models.kvsize import KvOptions, kv_cache_bytes, kv_layer_bytes
from supervisor.models.library import ModelEntry
from tests.tiny_mtp import write_tiny_mtp
from worker.protocol import SpeculativeOptions

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
N_CTX, SLOTS = 1024, 2

_LOAD = r"""
import os, sys
import xllamacpp
from worker.engine_api import EngineOptions
from worker.engine_params import engine_params
from worker.protocol import SpeculativeOptions
model, mode, draft, sock = sys.argv[1:5]
opts = EngineOptions(model, 1024, -1, 2, False, speculative=SpeculativeOptions(mode, draft, 0, 4),
                     parallel=2, engine_socket=sock)
params = engine_params(opts)
params.verbosity = 4
server = xllamacpp.Server(params)
print("loaded", flush=True)
sys.stderr.flush()
os._exit(0)
"""
_KV = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB")
_COMPUTE = re.compile(r"compute buffer size =\s*([\d.]+) MiB")


def engine_sizes(model: Path, mode: str, draft: str = "") -> tuple[list[float], list[float]]:
    """(KV cache MiB per context, compute buffer MiB per reservation), as logged."""
    # A short directory: the engine's listener is a Unix socket (108-byte paths).
    sock_dir = Path(tempfile.mkdtemp(prefix="gvdm"))
    try:
        done = subprocess.run([sys.executable, "-c", _LOAD, str(model), mode, draft, str(sock_dir / "e.sock")],
                              check=False, capture_output=True, text=True, timeout=120, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-3000:]
    return ([float(m) for m in _KV.findall(done.stderr)], [float(m) for m in _COMPUTE.findall(done.stderr)])


def entry_of(path: Path) -> ModelEntry:
    return ModelEntry(id=path.stem, path=str(path), files=[str(path)], size_bytes=path.stat().st_size,
                      source="dir", root=str(path.parent), mtime=0.0, info=read_gguf_info(path))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("draft-memory")


def test_a_draft_models_memory(root: Path) -> None:
    target = entry_of(write_tiny_gguf(root / "t.gguf", n_embd=128, n_layer=4, n_ff=256))
    draft = entry_of(write_tiny_gguf(root / "d.gguf", n_embd=128, n_layer=2, n_ff=256, seed=1))
    kv, compute = engine_sizes(Path(target.path), "draft", draft.path)
    assert len(kv) == 2, kv  # the model's context, then the draft's
    assert draft.info is not None
    ours = kv_cache_bytes(draft.info, N_CTX, KvOptions(slots=SLOTS)).total
    assert round(ours / MIB, 2) == kv[1]
    plan = SpeculativePlan(SpeculativeOptions("draft", draft.path, 0, 4), draft)
    assert draft_bytes(target, plan, n_ctx=N_CTX, slots=SLOTS) >= draft.size_bytes + (kv[1] + max(compute)) * MIB


def test_mtp_layers_memory(root: Path) -> None:
    target = entry_of(write_tiny_mtp(root / "m.gguf"))
    kv, compute = engine_sizes(Path(target.path), "mtp")
    assert len(kv) == 2, kv  # the model's context (without its NextN layer), then the MTP one
    assert target.info is not None
    layer = max(kv_layer_bytes(target.info, N_CTX, KvOptions(slots=SLOTS)))
    assert round(layer / MIB, 2) == kv[1]
    plan = SpeculativePlan(SpeculativeOptions("mtp", "", 0, 4))
    assert draft_bytes(target, plan, n_ctx=N_CTX, slots=SLOTS) >= (kv[1] + max(compute)) * MIB
