"""A split GGUF (``-00001-of-0000N.gguf``) loads as one model, and its load
progress is measured against all of its shards, not the first one alone."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from supervisor.app import timing_from
from supervisor.config import Config
from supervisor.models.demo import CHATML_TEMPLATE, add_tokenizer, demo_tensors, demo_vocab
from supervisor.models.library import ModelLibrary
from supervisor.models.source import LibrarySource
from supervisor.workers.pool import WorkerPool
from supervisor.workers.process import load_size
from worker import protocol as p

pytestmark = pytest.mark.timeout(120)


def write_split_tiny(path: Path, *, tensors_per_shard: int, n_embd: int = 64, n_layer: int = 2,
                     n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128) -> list[Path]:
    """The demo's tiny llama model as a shard set named after ``path``; the
    first shard holds only the header (as ``gguf-split`` writes it with
    ``--no-tensor-first-split``), so its size says nothing of the weights."""
    tokens, scores, types = demo_vocab(200)
    w = gguf.GGUFWriter(str(path), "llama", split_max_tensors=tensors_per_shard, small_first_shard=True)
    w.add_name("tiny-split")
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(w, tokens, scores, types, CHATML_TEMPLATE)
    for name, array in demo_tensors(np.random.default_rng(0), n_vocab=len(tokens), n_embd=n_embd,
                                    n_layer=n_layer, n_embd_kv=n_embd // n_head * n_head_kv,
                                    n_ff=n_ff).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))


async def test_a_split_model_loads_and_its_progress_counts_every_shard(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    shards = write_split_tiny(models / "tiny.gguf", tensors_per_shard=10)
    assert len(shards) >= 3 and shards[0].name == f"tiny-00001-of-{len(shards):05d}.gguf"
    library = ModelLibrary([models], None, settle_s=0.0)
    library.rescan()
    entry = library.get("tiny")
    assert entry is not None and entry.usable, entry
    total = sum(s.stat().st_size for s in shards)
    assert entry.size_bytes == total and len(entry.files) == len(shards)
    cfg = Config(n_ctx=512, min_ctx=256, parallel=1, n_threads=1)
    pool = WorkerPool(LibrarySource(library), cfg, timing_from(cfg), tmp_path / "run", tmp_path / "logs")
    try:
        gen = await pool.admit("tiny", messages=[p.ChatMessage(role="user", content="hi")],
                               params=p.SamplingParams(max_tokens=4, temperature=0.0))
        done = [ev async for ev in gen if isinstance(ev, p.Done)]
        assert done and done[0].completion_tokens > 0
        spec = pool.handles[("tiny", False)].spec
        assert spec.path == shards[0]
        # The first shard is the header alone: a small part of the model.
        assert shards[0].stat().st_size * 4 < total
        assert load_size(spec) == total
    finally:
        await pool.stop_all()
