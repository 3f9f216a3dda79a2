"""Header-only GGUF fixtures of several architectures, written with ``gguf``.

Each file has the key/value section a converted model of that family carries
(sizes shrunk) and no tensors: enough for the header reader and the memory
estimates, and a few hundred bytes on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import gguf

TOOLS_THINK_TEMPLATE = (
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if enable_thinking %}<think>{% endif %}"
)


def write_header(path: Path, arch: str, fill: Callable[[gguf.GGUFWriter], None]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"test-{arch}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _common(
    w: gguf.GGUFWriter,
    *,
    n_layer: int,
    n_embd: int,
    n_head: int | Sequence[int],
    n_head_kv: int | Sequence[int],
    ctx: int,
    n_ff: int | Sequence[int] = 256,
) -> None:
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_token_list([f"t{i}" for i in range(100)])


def llama_gqa(path: Path, template: str | None = TOOLS_THINK_TEMPLATE) -> Path:
    """32 layers, 4096 wide, 32 heads of 128, 8 KV heads (Llama-3-8B shape)."""

    def fill(w: gguf.GGUFWriter) -> None:
        _common(w, n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, ctx=8192)
        if template is not None:
            w.add_chat_template(template)

    return write_header(path, "llama", fill)


def gemma3_swa(path: Path) -> Path:
    """12 layers, 8 heads of 256, 4 KV heads, window 1024, 5 local : 1 global."""

    def fill(w: gguf.GGUFWriter) -> None:
        _common(w, n_layer=12, n_embd=1152, n_head=8, n_head_kv=4, ctx=32768)
        w.add_key_length(256)
        w.add_value_length(256)
        w.add_sliding_window(1024)

    return write_header(path, "gemma3", fill)


def deepseek2_mla(path: Path) -> Path:
    """MLA as converted today: latent 512 + rope 64 in K, one KV head, no V."""

    def fill(w: gguf.GGUFWriter) -> None:
        _common(w, n_layer=27, n_embd=2048, n_head=16, n_head_kv=1, ctx=163840)
        w.add_kv_lora_rank(512)
        w.add_key_length(576)
        w.add_value_length(512)
        w.add_key_length_mla(192)
        w.add_value_length_mla(128)
        w.add_rope_dimension_count(64)

    return write_header(path, "deepseek2", fill)


def jamba_hybrid(path: Path) -> Path:
    """8 layers, attention (8 KV heads of 64) on layers 3 and 7, Mamba elsewhere."""
    heads_kv = [0, 0, 0, 8, 0, 0, 0, 8]

    def fill(w: gguf.GGUFWriter) -> None:
        _common(w, n_layer=8, n_embd=512, n_head=8, n_head_kv=heads_kv, ctx=65536)
        w.add_ssm_conv_kernel(4)
        w.add_ssm_inner_size(1024)
        w.add_ssm_state_size(16)
        w.add_ssm_time_step_rank(32)

    return write_header(path, "jamba", fill)


def qwen3next_hybrid(path: Path) -> Path:
    """8 layers, full attention every 4th (layers 3 and 7), gated delta net elsewhere."""

    def fill(w: gguf.GGUFWriter) -> None:
        _common(w, n_layer=8, n_embd=1024, n_head=16, n_head_kv=2, ctx=262144)
        w.add_key_length(256)
        w.add_value_length(256)
        w.add_ssm_conv_kernel(4)
        w.add_ssm_inner_size(2048)
        w.add_ssm_state_size(128)
        w.add_ssm_time_step_rank(16)
        w.add_ssm_group_count(8)
        w.add_full_attention_interval(4)

    return write_header(path, "qwen3next", fill)


def gemma3n_shared(path: Path) -> Path:
    """30 layers, last 10 reuse earlier caches; explicit 4:1 SWA bool pattern."""
    pattern = [(il % 5) < 4 for il in range(30)]

    def fill(w: gguf.GGUFWriter) -> None:
        _common(w, n_layer=30, n_embd=2048, n_head=8, n_head_kv=2, ctx=32768)
        w.add_key_length(256)
        w.add_value_length(256)
        w.add_sliding_window(512)
        w.add_sliding_window_pattern(pattern)
        w.add_shared_kv_layers(10)

    return write_header(path, "gemma3n", fill)


def mmproj(path: Path) -> Path:
    def fill(w: gguf.GGUFWriter) -> None:
        w.add_type("mmproj")

    return write_header(path, "clip", fill)
