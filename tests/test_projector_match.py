"""Projectors are linked to the models of their folder that they fit, by header.

Real files throughout: tiny random text models and projectors the engine
loads (tests/tiny_vision.py), and header-only projectors carrying the keys
current converters write (``general.type = mmproj``, ``projection_dim``,
``clip.projector_type``). The last test serves a flat dir through the HTTP
API: only the fitting model takes an image.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.models.gguf_info import GgufInfo
from supervisor.models.library import ModelEntry, ModelLibrary
from supervisor.models.projector_match import facts_from_header, judge
from tests.gguf_headers import write_header
from tests.server import Server, running, short_tempdir
from tests.tiny_vision import png, write_tiny_mmproj, write_tiny_text_model

pytestmark = pytest.mark.timeout(180)


def text_header(path: Path, arch: str, n_embd: int) -> Path:
    """A header-only text model ``n_embd`` wide."""

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(2)
        w.add_feed_forward_length(4 * n_embd)
        w.add_head_count(4)
        w.add_head_count_kv(4)

    return write_header(path, arch, fill)


def clip_header(path: Path, *, width: object = None, kind: object = None, marked: bool = True,
                vision: bool = True, extra: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """A header-only projector: what a current converter writes (``marked``), or an older one."""
    w = gguf.GGUFWriter(str(path), "clip")
    if marked:
        w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", vision)
    w.add_bool("clip.has_audio_encoder", False)
    if isinstance(kind, str):
        w.add_string("clip.projector_type", kind)
    if isinstance(width, bool):
        w.add_bool("clip.vision.projection_dim", width)
    elif isinstance(width, int):
        w.add_int64("clip.vision.projection_dim", width)
    elif isinstance(width, str):
        w.add_string("clip.vision.projection_dim", width)
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def scan(root: Path) -> dict[str, ModelEntry]:
    lib = ModelLibrary([root], settle_s=0)
    lib.rescan()
    return {e.id: e for e in lib.list()}


def linked(entry: ModelEntry) -> str | None:
    return Path(entry.mmproj).name if entry.mmproj else None


def test_a_flat_dir_links_the_projector_to_the_model_of_its_width(tmp_path: Path) -> None:
    write_tiny_text_model(tmp_path / "small.gguf", n_embd=64)
    write_tiny_text_model(tmp_path / "wide.gguf", n_embd=128, seed=1)
    write_tiny_mmproj(tmp_path / "mmproj-tiny.gguf", text_embd=64)
    models = scan(tmp_path)
    assert set(models) == {"small", "wide"}
    assert linked(models["small"]) == "mmproj-tiny.gguf" and models["small"].projector_note is None
    assert linked(models["wide"]) is None
    note = models["wide"].projector_note
    assert note is not None and "mmproj-tiny.gguf" in note and "64" in note and "128" in note


def test_a_projector_that_fits_neither_links_none(tmp_path: Path) -> None:
    write_tiny_text_model(tmp_path / "small.gguf", n_embd=64)
    write_tiny_text_model(tmp_path / "wide.gguf", n_embd=128, seed=1)
    write_tiny_mmproj(tmp_path / "mmproj-other.gguf", text_embd=96)
    models = scan(tmp_path)
    for entry in models.values():
        assert entry.mmproj is None
        assert entry.projector_note is not None and "width 96" in entry.projector_note


def test_the_width_key_of_current_converters_decides(tmp_path: Path) -> None:
    text_header(tmp_path / "a.gguf", "llama", 2048)
    text_header(tmp_path / "b.gguf", "llama", 4096)
    clip_header(tmp_path / "mmproj-b.gguf", width=4096, kind="pixtral")
    models = scan(tmp_path)
    assert linked(models["b"]) == "mmproj-b.gguf"
    assert linked(models["a"]) is None and "4096" in (models["a"].projector_note or "")


def test_a_family_projector_fits_only_its_family(tmp_path: Path) -> None:
    text_header(tmp_path / "gemma-3-4b.gguf", "gemma3", 2560)
    text_header(tmp_path / "other-4b.gguf", "llama", 2560)  # same width, other family
    clip_header(tmp_path / "mmproj-gemma-3-4b-f16.gguf", width=2560, kind="gemma3")
    models = scan(tmp_path)
    assert linked(models["gemma-3-4b"]) == "mmproj-gemma-3-4b-f16.gguf"
    assert linked(models["other-4b"]) is None
    note = models["other-4b"].projector_note or ""
    assert "gemma3" in note and "llama" in note


def test_of_several_fitting_projectors_the_family_then_the_name_wins(tmp_path: Path) -> None:
    text_header(tmp_path / "gemma-3-4b.gguf", "gemma3", 2560)
    text_header(tmp_path / "pix-12b.gguf", "llama", 2560)
    clip_header(tmp_path / "mmproj-a-any-f16.gguf", width=2560, kind="pixtral")
    clip_header(tmp_path / "mmproj-z-gemma3.gguf", width=2560, kind="gemma3")
    clip_header(tmp_path / "mmproj-pix-12b-Q8_0.gguf", width=2560, kind="pixtral")
    models = scan(tmp_path)
    # Its family's projector, though another is named f16 and sorts first.
    assert linked(models["gemma-3-4b"]) == "mmproj-z-gemma3.gguf"
    # The gemma3 one is ruled out; of the two left, the one named like the model.
    assert linked(models["pix-12b"]) == "mmproj-pix-12b-Q8_0.gguf"


def test_quants_of_one_model_share_its_projector(tmp_path: Path) -> None:
    for quant in ("Q4_K_M", "Q8_0"):
        text_header(tmp_path / f"vl-2b-{quant}.gguf", "qwen2vl", 1536)
    clip_header(tmp_path / "mmproj-vl-2b-f16.gguf", width=1536, kind="qwen2.5vl_merger")
    clip_header(tmp_path / "mmproj-vl-2b-Q8_0.gguf", width=1536, kind="qwen2.5vl_merger")
    models = scan(tmp_path)
    assert len(models) == 2 and {linked(e) for e in models.values()} == {"mmproj-vl-2b-f16.gguf"}


def test_a_header_that_cannot_tell_is_linked_by_folder_with_a_note(tmp_path: Path) -> None:
    text_header(tmp_path / "a.gguf", "llama", 4096)
    # An older converter's file (no general.type): its width key held the encoder's width.
    clip_header(tmp_path / "mmproj-old.gguf", width=768, kind="ldp", marked=False)
    entry = scan(tmp_path)["a"]
    assert linked(entry) == "mmproj-old.gguf"
    assert entry.projector_note is not None and "unchecked" in entry.projector_note
    # One that is known to fit is preferred to it.
    clip_header(tmp_path / "mmproj-new.gguf", width=4096, kind="ldp")
    entry = scan(tmp_path)["a"]
    assert linked(entry) == "mmproj-new.gguf" and entry.projector_note is None


def test_a_projector_without_encoders_fits_nothing(tmp_path: Path) -> None:
    text_header(tmp_path / "a.gguf", "llama", 4096)
    clip_header(tmp_path / "mmproj-empty.gguf", width=4096, vision=False)
    entry = scan(tmp_path)["a"]
    assert entry.mmproj is None and "no vision or audio encoder" in (entry.projector_note or "")


@pytest.mark.parametrize("width", [-1, 0, True, "4096", 1 << 62])
def test_hostile_width_keys_never_link_a_wrong_pair(tmp_path: Path, width: object) -> None:
    text_header(tmp_path / "a.gguf", "llama", 4096)
    clip_header(tmp_path / "mmproj-x.gguf", width=width, kind="x" * 5000)
    entry = scan(tmp_path)["a"]
    if entry.mmproj is not None:  # only ever as unchecked, never as a fit
        assert "unchecked" in (entry.projector_note or "")
    else:
        assert entry.projector_note is not None
    assert len(entry.projector_note or "") <= 300


def test_a_truncated_projector_costs_only_its_link(tmp_path: Path) -> None:
    text_header(tmp_path / "a.gguf", "llama", 4096)
    whole = clip_header(tmp_path / "full.bin", width=4096, kind="gemma3").read_bytes()
    for cut in (0, 10, 30, len(whole) // 2, len(whole) - 40):
        (tmp_path / "mmproj-cut.gguf").write_bytes(whole[:cut])
        entry = scan(tmp_path)["a"]
        assert entry.usable
        assert entry.projector_note is not None and "unreadable" in entry.projector_note


# ---------------------------------------------------------------- served


def _look(image: bytes) -> list[dict[str, Any]]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return [{"role": "user", "content": [{"type": "text", "text": "look: "},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_only_the_fitting_model_of_a_flat_dir_takes_images(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_text_model(models / "small.gguf", n_embd=64)
    write_tiny_text_model(models / "wide.gguf", n_embd=128, seed=1)
    write_tiny_mmproj(models / "mmproj-tiny.gguf", text_embd=64)
    with running(Server(models, state_dir=short_tempdir(), model="small",
                        env={"GPUVISOR_N_CTX": "2048"})) as srv:
        api = {m["id"]: m for m in httpx.get(srv.base_url + "/api/models", timeout=10).json()["data"]}
        assert api["small"]["vision"] is True and api["small"]["projector_note"] is None
        assert api["wide"]["vision"] is False and api["wide"]["mmproj"] is None
        assert "width 64" in api["wide"]["projector_note"]
        v1 = {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]}
        assert v1["small"]["vision"] is True and v1["wide"]["vision"] is False
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        seen = client.chat.completions.create(model="small", messages=_look(png(32, 32, (255, 0, 0))),  # type: ignore[arg-type]
                                              temperature=0, max_tokens=4)
        assert seen.usage is not None and seen.usage.prompt_tokens >= 16  # the image's 16 embeddings
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="wide", messages=_look(png(32, 32, (255, 0, 0))),  # type: ignore[arg-type]
                                           temperature=0, max_tokens=4)
        assert err.value.code == "vision_unavailable" and "width 64" in err.value.message
        text = client.chat.completions.create(model="wide", messages=[{"role": "user", "content": "hi"}],
                                              temperature=0, max_tokens=4)
        assert text.choices[0].message.content is not None
        # Loaded, it still serves text only, with no projector error to report.
        wide = {m["id"]: m for m in httpx.get(srv.base_url + "/api/models", timeout=10).json()["data"]}["wide"]
        assert wide["vision"] is False and wide["vision_error"] is None


_KEYS = ["general.architecture", "general.type", "clip.has_vision_encoder", "clip.has_audio_encoder",
         "clip.projector_type", "clip.vision.projector_type", "clip.audio.projector_type",
         "clip.vision.projection_dim", "clip.audio.projection_dim"]
_VALUES = (st.sampled_from(["clip", "mmproj", "mlp", "gemma3", "qwen3vl_merger", "llama", ""])
           | st.booleans() | st.integers(-2, 1 << 64) | st.floats() | st.text(max_size=20)
           | st.lists(st.integers(0, 9), max_size=3))


@settings(max_examples=200, deadline=None)
@given(kv=st.dictionaries(st.sampled_from(_KEYS), _VALUES),
       dims=st.lists(st.integers(0, 1 << 64), max_size=3), n_embd=st.sampled_from([0, 64, 4096]),
       arch=st.sampled_from(["llama", "gemma3", "qwen3vl", ""]))
def test_any_header_values_give_a_verdict_and_a_fit_only_at_the_width(
        kv: dict[str, Any], dims: list[int], n_embd: int, arch: str) -> None:
    facts = facts_from_header(kv, {"mm.2.weight": dims})
    verdict, why = judge(GgufInfo(architecture=arch, n_embd=n_embd), facts)
    assert verdict in ("fits", "unknown", "misfit")
    if verdict == "fits":
        assert facts.width == n_embd > 0 and why == ""
    else:
        assert why and len(why) < 400
