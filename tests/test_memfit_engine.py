"""memfit's estimates against what the engine itself allocates.

Each case loads a tiny model in llama.cpp's server engine, in a subprocess,
with the worker's own engine settings (``worker.engine_params.engine_params``), and reads
the sizes the engine logs while it builds the context: one KV cache line per
cache (a sliding-window model has two, full and windowed) and one compute
buffer line per backend. The engine prints MiB with two decimals, so the KV
cache is compared to that precision, and cell and layer counts exactly.

The compute buffer estimate is an upper bound: llama.cpp's graph allocator
reuses memory within a layer in ways that depend on the backend, so memfit
counts one layer's activations with no reuse, the masks in f32, and the
logit rows. Measured on the CPU it is 1.3x to 2.1x the engine's figure (the
most where the attention mask dominates: the engine keeps it in f16, memfit
counts f32); the assertion allows up to 4x + 4 MiB.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from supervisor.config import ModelSettings
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.gguf_info import GgufInfo, read_gguf_info
from supervisor.models.kvsize import compute_buffer_bytes, kv_cache_bytes, row_bytes
from supervisor.models.placement import kv_options
from tests.tiny_models import write_tiny_gemma3

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024

# Builds the engine exactly as a worker does; only the log level is raised,
# because the buffer sizes are logged at info level.
_LOAD = r"""
import os
import sys
import xllamacpp
from worker.engine_api import EngineOptions
from worker.engine_params import engine_params

path, n_ctx, parallel, cache, embedding, sock = sys.argv[1:7]
opts = EngineOptions(path, int(n_ctx), -1, 2, embedding == "1", cache,
                     parallel=int(parallel), engine_socket=sock)
params = engine_params(opts)
params.verbosity = 4
server = xllamacpp.Server(params)
print("loaded", flush=True)
sys.stderr.flush()
# The engine's destructor can hang at interpreter exit (the worker leaves
# the same way, for the same reason).
os._exit(0)
"""

_KV_LINE = re.compile(
    r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\),"
    r" K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB"
)
_COMPUTE_LINE = re.compile(r"(\S+) compute buffer size =\s*([\d.]+) MiB")
_FLASH_LINE = re.compile(r"llama_context: flash_attn\s*=\s*(\w+)")


class KvLine(msgspec.Struct, frozen=True):
    cells: int
    layers: int
    k_mib: float
    v_mib: float


class EngineLog(msgspec.Struct, frozen=True):
    caches: list[KvLine]
    compute_mib: float
    flash_attn: str


def parse_engine_log(text: str) -> EngineLog:
    caches = [
        KvLine(int(m[2]), int(m[3]), float(m[7]), float(m[9])) for m in _KV_LINE.finditer(text)
    ]
    compute = sum(float(m[2]) for m in _COMPUTE_LINE.finditer(text))
    flash = _FLASH_LINE.search(text)
    return EngineLog(caches, compute, flash[1] if flash else "")


def load_in_engine(model: Path, n_ctx: int, parallel: int, cache: str, embedding: bool) -> EngineLog:
    # A short directory: the engine's listener is a Unix socket (108-byte paths).
    sock_dir = Path(tempfile.mkdtemp(prefix="gvmf"))
    try:
        done = subprocess.run(
            [sys.executable, "-c", _LOAD, str(model), str(n_ctx), str(parallel), cache,
             "1" if embedding else "0", str(sock_dir / "e.sock")],
            check=False, capture_output=True, text=True, timeout=120, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-3000:]
    return parse_engine_log(done.stderr)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("engine-models")
    # Heads of 32 values: q8_0 blocks are 32 wide and must divide a head.
    yield {
        "llama": write_tiny_gguf(root / "llama.gguf", n_embd=128, n_head=4, n_head_kv=2, n_ff=256),
        "gemma3": write_tiny_gemma3(root / "gemma3.gguf"),
    }


def _mib(n: int) -> float:
    return n / MIB


def _kv_by_cache(info: GgufInfo, n_ctx: int, parallel: int, cache: str,
                 embedding: bool) -> list[tuple[int, int, int, int]]:
    """(cells, layers, K bytes, V bytes) per cache as memfit sizes them:
    the full-attention cache first, then the sliding-window one."""
    opts = kv_options(ModelSettings(cache_type=cache), slots=parallel,  # type: ignore[arg-type]
                      embedding=embedding)
    est = kv_cache_bytes(info, n_ctx, opts)
    streams = parallel if not embedding else 1
    out = []
    for swa, cells in ((False, est.n_cells), (True, est.n_cells_swa)):
        layers = [il for il in range(info.n_layer)
                  if info.attention_layers[il] and info.swa_layers[il] == swa]
        if not layers:
            continue
        head_k = info.key_length_swa if swa else info.key_length
        head_v = info.value_length_swa if swa else info.value_length
        k = sum(row_bytes(cache, head_k * info.n_head_kv_per_layer[il]) for il in layers)
        v = sum(row_bytes(cache, head_v * info.n_head_kv_per_layer[il]) for il in layers)
        out.append((cells, len(layers), k * cells * streams, v * cells * streams))
    # The per-cache split must add up to memfit's own totals.
    assert sum(c[2] for c in out) == est.k_bytes and sum(c[3] for c in out) == est.v_bytes
    return out


CASES = [
    # (model, per-request n_ctx, slots, cache type, embedding)
    ("llama", 4096, 1, "f16", False),
    ("llama", 1000, 2, "f16", False),
    ("llama", 1000, 1, "q8_0", False),
    ("llama", 4096, 2, "q8_0", False),
    ("llama", 2048, 2, "f16", True),
    ("gemma3", 4096, 1, "f16", False),
    ("gemma3", 4096, 2, "f16", False),
    ("gemma3", 1000, 2, "q8_0", False),
    ("gemma3", 512, 1, "f16", False),
]


@pytest.mark.parametrize(("model", "n_ctx", "parallel", "cache", "embedding"), CASES)
def test_estimate_matches_engine(models: dict[str, Path], model: str, n_ctx: int, parallel: int,
                                 cache: str, embedding: bool) -> None:
    path = models[model]
    info = read_gguf_info(path)
    log = load_in_engine(path, n_ctx, parallel, cache, embedding)
    # memfit assumes flash attention; the worker must force it, not leave it to "auto".
    assert log.flash_attn == "enabled"

    expected = _kv_by_cache(info, n_ctx, parallel, cache, embedding)
    assert len(log.caches) == len(expected)
    for got, (cells, layers, k, v) in zip(log.caches, expected, strict=True):
        # The engine logs cells per stream; memfit counts the same.
        assert (got.cells, got.layers) == (cells, layers)
        assert f"{got.k_mib:.2f}" == f"{_mib(k):.2f}"
        assert f"{got.v_mib:.2f}" == f"{_mib(v):.2f}"

    opts = kv_options(ModelSettings(cache_type=cache), slots=parallel,  # type: ignore[arg-type]
                      embedding=embedding)
    estimate = _mib(compute_buffer_bytes(info, n_ctx, opts))
    ratio = estimate / log.compute_mib
    print(f"{model} n_ctx={n_ctx} P={parallel} {cache} emb={embedding}: "
          f"KV engine {[(c.k_mib, c.v_mib) for c in log.caches]} MiB, "
          f"compute engine {log.compute_mib:.2f} MiB, memfit {estimate:.2f} MiB ({ratio:.2f}x)")
    assert log.compute_mib <= estimate <= 4 * log.compute_mib + 4
