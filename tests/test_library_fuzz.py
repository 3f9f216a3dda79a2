"""No file's facts stop the library: crafted GGUF headers (models, LoRA
adapters, projectors, drafts) cost the file they are in, which is listed
unusable with the reason, and never a scan, start-up or another model.

The regression behind it (red team, round 3): a 416-byte GGUF with one
tensor ``blk.0.attn_q.weight`` of shape (64,), beside a llama LoRA adapter
that records no base, raised IndexError in the adapter linking; every
rescan failed after it (a 33-line traceback a second) and a restarted
service bound its port but never answered.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.config import ModelSettings
from supervisor.errors import ApiError
from supervisor.models.draft import plan_speculative
from supervisor.models.gguf_info import GgufInfo, read_gguf_info
from supervisor.models.library import ModelLibrary, ModelEntry
from supervisor.models.projector import projector_modalities
from tests.server import Server, poll_until, short_tempdir
from worker.vision import ProjectorError, check_projector

pytestmark = pytest.mark.timeout(180)

# GGUF value types.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_PACK = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q",
         F64: "d"}

KV = tuple[str, int, Any]  # key, type, value (an array: (element type, items))
Tensor = tuple[str, Sequence[int]]  # name, ggml dims (ne[0] first)


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: int, value: Any) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        elem, items = value
        return struct.pack("<IQ", elem, len(items)) + b"".join(_value(elem, v) for v in items)
    return struct.pack("<" + _PACK[kind], value)


def gguf_bytes(kv: Sequence[KV], tensors: Sequence[Tensor] = ()) -> bytes:
    """A GGUF v3 file: the header, then zeroed F32 tensor data at 32-byte alignment."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(kv))]
    out += [_string(key) + struct.pack("<I", kind) + _value(kind, value) for key, kind, value in kv]
    offset = 0
    sizes = []
    for name, dims in tensors:
        n = 4
        for d in dims:
            n *= max(d, 0)
        sizes.append(min(n, 1 << 16))  # a crafted shape need not have its data
        out.append(_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
                   + struct.pack("<IQ", 0, offset))
        offset += (sizes[-1] + 31) // 32 * 32
    head = b"".join(out)
    head += bytes(-len(head) % 32)
    return head + b"".join(bytes((n + 31) // 32 * 32) for n in sizes)


def lora_adapter(base_name: str | None = None, rank: int = 4, width: int = 64) -> bytes:
    kv: list[KV] = [("general.architecture", STRING, "llama"), ("general.type", STRING, "adapter"),
                    ("adapter.type", STRING, "lora"), ("adapter.lora.alpha", F32, 8.0)]
    if base_name is not None:
        kv.append(("general.base_model.0.name", STRING, base_name))
    return gguf_bytes(kv, [("blk.0.attn_q.weight.lora_a", (width, rank)),
                           ("blk.0.attn_q.weight.lora_b", (rank, width))])


def one_d_base() -> bytes:
    """The issue's repro: a llama model whose attn_q weight has one dimension."""
    return gguf_bytes([("general.architecture", STRING, "llama")], [("blk.0.attn_q.weight", (64,))])


def _scan(models: Path) -> ModelLibrary:
    lib = ModelLibrary([models], settle_s=0)
    lib.rescan()
    return lib


def test_a_1d_tensor_where_the_adapter_expects_2d_costs_the_link_only(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "base.gguf").write_bytes(one_d_base())
    (tmp_path / "lora.gguf").write_bytes(lora_adapter())
    assert len(one_d_base()) <= 416
    lib = _scan(tmp_path)
    assert lib.get("base") is not None and lib.get("base").usable  # type: ignore[union-attr]
    (adapter,) = lib.adapters()
    assert not adapter.usable and adapter.reason is not None
    (link,) = adapter.links
    assert not link.fits and link.reason == "blk.0.attn_q.weight is 64 in the base, the adapter expects 64x64"
    # Scans after it still work, and still notice changes.
    (tmp_path / "later.gguf").write_bytes(gguf_bytes([("general.architecture", STRING, "llama")]))
    with caplog.at_level(logging.WARNING):
        lib.rescan()
        lib.rescan()
    assert lib.get("later") is not None
    assert "Traceback" not in caplog.text


def test_a_fault_in_one_files_facts_is_its_reason_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a reader raises (not only the errors it expects) makes that file unusable."""
    def broken(*_: object) -> NoReturn:
        raise KeyError("a fault no reader expected")

    def read_info(path: Path) -> GgufInfo:
        if path.name == "model.gguf":
            broken()
        return read_gguf_info(path)

    (tmp_path / "model.gguf").write_bytes(gguf_bytes([("general.architecture", STRING, "llama")]))
    (tmp_path / "other.gguf").write_bytes(gguf_bytes([("general.architecture", STRING, "qwen2")]))
    (tmp_path / "lora.gguf").write_bytes(lora_adapter())
    monkeypatch.setattr("supervisor.models.library.read_gguf_info", read_info)
    monkeypatch.setattr("supervisor.models.adapters.adapter_info", broken)
    lib = ModelLibrary([tmp_path], settle_s=0)
    with caplog.at_level(logging.WARNING, logger="supervisor.models.library"):
        for _ in range(3):
            lib.rescan()
    model = lib.get("model")
    assert model is not None and not model.usable and "KeyError" in (model.reason or "")
    assert lib.get("other") is not None and lib.get("other").usable  # type: ignore[union-attr]
    (adapter,) = lib.adapters()
    assert not adapter.usable and "KeyError" in (adapter.reason or "")
    faults = [r for r in caplog.records if "KeyError" in r.getMessage()]
    assert len(faults) == 2 and all(r.exc_info is None for r in faults), [r.getMessage() for r in faults]


# ------------------------------------------------------------------ fuzzing

_KEYS = ["general.architecture", "general.type", "general.name", "general.base_model.0.name", "adapter.type",
         "adapter.lora.alpha", "general.file_type", "split.count", "llama.block_count", "llama.context_length",
         "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
         "llama.attention.head_count_kv", "llama.attention.key_length", "llama.attention.value_length",
         "llama.attention.sliding_window", "llama.attention.sliding_window_pattern", "llama.vocab_size",
         "llama.nextn_predict_layers", "llama.rope.dimension_count", "llama.expert_count",
         "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
         "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template",
         "clip.has_vision_encoder", "clip.has_audio_encoder", "clip.projector_type", "clip.vision.image_size",
         "clip.vision.image_mean", "clip.vision.image_std", "clip.vision.embedding_length"]
_TENSORS = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.1.ffn_up.weight", "token_embd.weight",
            "output.weight", "blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b", "v.patch_embd.weight",
            "clip.vision.image_mean", "blk.99999.attn_q.weight"]
_WORDS = st.sampled_from(["llama", "qwen2", "clip", "adapter", "lora", "model", "", "gpt2", "base", "\x00", "ü" * 3])
_SCALAR = st.one_of(
    st.tuples(st.sampled_from([U8, I8, U16, I16, U32, I32]), st.integers(-128, 127)).map(
        lambda t: (t[0], t[1] % (1 << 8) if t[0] in (U8, U16, U32) else t[1])),
    st.tuples(st.just(U64), st.sampled_from([0, 1, 2, 64, 2**32, 2**63, 2**64 - 1])),
    st.tuples(st.just(I64), st.sampled_from([-(2**63), -1, 0, 1, 2**62])),
    st.tuples(st.sampled_from([F32, F64]), st.sampled_from([0.0, -1.0, 1e-6, 1e38, float("inf"), float("nan")])),
    st.tuples(st.just(BOOL), st.booleans()),
    st.tuples(st.just(STRING), _WORDS),
)
_VALUE = st.one_of(
    _SCALAR,
    _SCALAR.flatmap(lambda s: st.tuples(st.just(ARRAY), st.tuples(st.just(s[0]), st.lists(st.just(s[1]),
                                                                                           max_size=5)))),
)
_KV = st.lists(st.tuples(st.sampled_from(_KEYS), _VALUE).map(lambda t: (t[0], t[1][0], t[1][1])),
               max_size=12, unique_by=lambda kv: kv[0])
_DIM = st.sampled_from([0, 1, 4, 64, 65, 2**32, 2**63])
_TENSOR_LIST = st.lists(st.tuples(st.sampled_from(_TENSORS), st.lists(_DIM, max_size=4)), max_size=5,
                        unique_by=lambda t: t[0])


def _with(kv: list[KV], fixed: Sequence[KV]) -> list[KV]:
    keys = {k for k, _, _ in fixed}
    return [*fixed, *(item for item in kv if item[0] not in keys)]


_WEIGHTS = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.1.ffn_up.weight", "output.weight"]
_SMALL = st.sampled_from([0, 1, 4, 64, 65])


@st.composite
def _lora_tensors(draw: st.DrawFn) -> list[Tensor]:
    """Mostly well-paired lora_a/lora_b tensors (so that linking gets as far as
    the base's shapes), sometimes not."""
    out: list[Tensor] = []
    for weight in draw(st.lists(st.sampled_from(_WEIGHTS), min_size=1, max_size=3, unique=True)):
        n_in, n_out, rank = draw(_SMALL), draw(_SMALL), draw(st.sampled_from([1, 4]))
        a: list[int] = [n_in, rank]
        b: list[int] = [rank, n_out]
        if draw(st.integers(0, 5)) == 0:
            a = draw(st.lists(_DIM, max_size=3))
        out += [(weight + ".lora_a", a), (weight + ".lora_b", b)]
    return out


@st.composite
def _base_tensors(draw: st.DrawFn) -> list[Tensor]:
    """The weights adapters change, with any number of dims (none to three)."""
    names = draw(st.lists(st.sampled_from(_WEIGHTS + _TENSORS), max_size=5, unique=True))
    return [(name, draw(st.lists(_SMALL | _DIM, max_size=3))) for name in names]


@st.composite
def _models_dir(draw: st.DrawFn) -> dict[str, bytes]:
    """A base, a LoRA adapter, a projector and a draft, each with crafted header keys and tensors."""
    arch = draw(st.sampled_from(["llama", "qwen2"]))
    base_kv = _with(draw(_KV), [("general.architecture", STRING, arch)] if draw(st.integers(0, 9)) else [])
    adapter_fixed: list[KV] = [("general.architecture", STRING, arch), ("general.type", STRING, "adapter"),
                               ("adapter.type", STRING, draw(st.sampled_from(["lora", "lora", "other"])))]
    if draw(st.booleans()):
        adapter_fixed.append(("general.base_model.0.name", STRING, draw(st.sampled_from(["base", "m/base", "x"]))))
    adapter_kv = _with(draw(_KV), adapter_fixed)
    clip_kv = _with(draw(_KV), [("general.architecture", STRING, "clip")])
    draft_kv = _with(draw(_KV), [("general.architecture", STRING, arch)])
    return {
        "m/base.gguf": gguf_bytes(base_kv, draw(_base_tensors())),
        "m/lora.gguf": gguf_bytes(adapter_kv, draw(_lora_tensors())),
        "m/mmproj-base.gguf": gguf_bytes(clip_kv, draw(_TENSOR_LIST)),
        "m/draft.gguf": gguf_bytes(draft_kv, draw(_TENSOR_LIST)),
    }


def _check_entry(lib: ModelLibrary, entry: ModelEntry) -> None:
    assert entry.usable or entry.reason, entry
    if entry.mmproj is not None:
        projector_modalities(entry.mmproj)  # what /api/models shows: must not raise
        try:
            check_projector(Path(entry.mmproj))  # what the worker checks before loading it
        except ProjectorError:
            pass
    if entry.usable and entry.id != "m/draft":
        draft = ModelSettings(speculative="draft", draft_model="m/draft")
        try:
            plan_speculative(entry, draft, _Source(lib))
        except ApiError:
            pass  # a refusal naming the setting: the load's 400, not a crash


class _Source:
    def __init__(self, lib: ModelLibrary) -> None:
        self.lib = lib

    def entry(self, model_id: str) -> ModelEntry | None:
        return self.lib.get(model_id)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(files=_models_dir())
def test_crafted_headers_never_stop_a_scan(files: dict[str, bytes], tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("fuzz")
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    lib = _scan(root)
    lib.rescan()  # again, from its caches
    for entry in lib.list():
        _check_entry(lib, entry)
    for adapter in lib.adapters():
        assert adapter.usable or adapter.reason, adapter
        for link in adapter.links:
            assert link.fits or link.reason, link


# ------------------------------------------------------------------ the service


def _listed(srv: Server) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]}


def test_the_service_starts_and_keeps_watching_beside_the_repro(
        tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvf")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    (models / "base.gguf").write_bytes(one_d_base())
    (models / "lora.gguf").write_bytes(lora_adapter())
    srv = start_server(models, env={"GPUVISOR_LIBRARY_SETTLE_S": "0.2"}, wait_ready=False)
    started = time.monotonic()
    poll_until(lambda: _ready(srv), bool, timeout=30)
    took = time.monotonic() - started
    listed = _listed(srv)
    assert {"tiny", "base"} <= set(listed), listed
    # The watcher still follows the directory.
    (models / ".later.tmp").write_bytes(gguf_bytes([("general.architecture", STRING, "llama")]))
    os.replace(models / ".later.tmp", models / "later.gguf")
    poll_until(lambda: _listed(srv), lambda m: "later" in m, timeout=30)
    log = srv.log_text()
    assert "Traceback" not in log and "watcher failed" not in log, log[-3000:]
    assert took < 30


def _ready(srv: Server) -> bool:
    try:
        return httpx.get(srv.base_url + "/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
