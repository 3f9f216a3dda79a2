"""A tiny random-weight vision model pair: a text GGUF and its mmproj GGUF.

The projector is LLaVA-style (``clip.projector_type = "mlp"``): a ViT over
square patches, then a two-layer MLP into the text model's embedding space.
It is the simplest projector llama.cpp's clip loader accepts: one image is
``(image_size / patch_size) ** 2`` embeddings, with no special tokens around
them. Tensor names and header keys follow llama.cpp's clip loader; numpy
shapes are (ne1, ne0, ...), rows first, as gguf stores them. Weights are
random, so outputs are gibberish, but deterministic under greedy decoding
and dependent on the image's pixels.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from supervisor.models.demo import finish_gguf, write_tiny_gguf

TEXT_EMBD = 64


def write_tiny_text_model(path: Path, *, seed: int = 0, n_embd: int = TEXT_EMBD, n_layer: int = 2,
                          n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128, n_ctx: int = 2048,
                          n_words: int = 200) -> Path:
    """The demo model's random llama-architecture text GGUF (F32, ChatML
    template), at the width the projector maps into."""
    return write_tiny_gguf(path, seed=seed, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                           n_head_kv=n_head_kv, n_ff=n_ff, n_ctx=n_ctx, extra_tokens=n_words,
                           name="tiny-random-vl")


def ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.float32)


def clip_writer(tmp: Path, name: str, modality: str, projector_type: str, *, n_embd: int, n_ff: int,
                n_layer: int, n_head: int, text_embd: int, eps: float) -> gguf.GGUFWriter:
    """A projector file's writer with the keys llama.cpp's clip loader reads
    for a ``modality`` ("vision" or "audio") encoder."""
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_bool("clip.has_vision_encoder", modality == "vision")
    w.add_bool("clip.has_audio_encoder", modality == "audio")
    w.add_string("clip.projector_type", projector_type)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32(f"clip.{modality}.embedding_length", n_embd)
    w.add_uint32(f"clip.{modality}.feed_forward_length", n_ff)
    w.add_uint32(f"clip.{modality}.block_count", n_layer)
    w.add_uint32(f"clip.{modality}.projection_dim", text_embd)
    w.add_uint32(f"clip.{modality}.attention.head_count", n_head)
    w.add_float32(f"clip.{modality}.attention.layer_norm_epsilon", eps)
    return w


def add_encoder_blocks(w: gguf.GGUFWriter, rand: Callable[..., np.ndarray], prefix: str, *, n_layer: int,
                       n_embd: int, n_ff: int, key_bias: bool = True) -> None:
    """The encoder's pre-norm transformer blocks (``v.blk.N`` or ``a.blk.N``)."""
    for i in range(n_layer):
        b = f"{prefix}.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{b}.{name}.weight", rand(n_embd, n_embd))
            if key_bias or name != "attn_k":  # whisper's key projection has no bias
                w.add_tensor(f"{b}.{name}.bias", zeros(n_embd))
        for name in ("ln1", "ln2"):
            w.add_tensor(f"{b}.{name}.weight", ones(n_embd))
            w.add_tensor(f"{b}.{name}.bias", zeros(n_embd))
        # n_ff != n_embd: the loader swaps up/down of old files whose down
        # projection's input width equals n_embd.
        w.add_tensor(f"{b}.ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(f"{b}.ffn_up.bias", zeros(n_ff))
        w.add_tensor(f"{b}.ffn_down.weight", rand(n_embd, n_ff))
        w.add_tensor(f"{b}.ffn_down.bias", zeros(n_embd))


def write_tiny_mmproj(
    path: Path,
    *,
    seed: int = 0,
    text_embd: int = TEXT_EMBD,
    image_size: int = 32,
    patch_size: int = 8,
    n_embd: int = 32,
    n_head: int = 2,
    n_ff: int = 48,
    n_layer: int = 2,
    proj_hidden: int = 48,
) -> Path:
    """Write a random LLaVA-style mmproj (F32) whose output is ``text_embd`` wide."""
    rng = np.random.default_rng(seed)
    n_pos = (image_size // patch_size) ** 2
    tmp = path.with_name(path.name + ".tmp")
    w = clip_writer(tmp, "tiny-random-mmproj", "vision", "mlp", n_embd=n_embd, n_ff=n_ff,
                    n_layer=n_layer, n_head=n_head, text_embd=text_embd, eps=1e-6)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch_size)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    # Conv kernel ne = [patch, patch, 3, n_embd].
    w.add_tensor("v.patch_embd.weight", rand(n_embd, 3, patch_size, patch_size))
    w.add_tensor("v.patch_embd.bias", zeros(n_embd))
    w.add_tensor("v.position_embd.weight", rand(n_pos, n_embd))
    w.add_tensor("v.pre_ln.weight", ones(n_embd))
    w.add_tensor("v.pre_ln.bias", zeros(n_embd))
    add_encoder_blocks(w, rand, "v", n_layer=n_layer, n_embd=n_embd, n_ff=n_ff)
    w.add_tensor("mm.0.weight", rand(proj_hidden, n_embd))
    w.add_tensor("mm.0.bias", zeros(proj_hidden))
    w.add_tensor("mm.2.weight", rand(text_embd, proj_hidden))
    w.add_tensor("mm.2.bias", zeros(text_embd))
    return finish_gguf(w, tmp, path)


def write_tiny_vision_pair(directory: Path, *, seed: int = 0) -> tuple[Path, Path]:
    """The text model and its projector, in ``directory``."""
    text = write_tiny_text_model(directory / "tiny-vl.gguf", seed=seed)
    mmproj = write_tiny_mmproj(directory / "mmproj-tiny-vl.gguf", seed=seed, text_embd=TEXT_EMBD)
    return text, mmproj


def png(width: int, height: int, rgb: tuple[int, int, int] | None = None, *, seed: int = 0) -> bytes:
    """A truecolour PNG: one colour, or random pixels from ``seed``."""
    if rgb is not None:
        pixels = np.empty((height, width, 3), dtype=np.uint8)
        pixels[:, :] = rgb
    else:
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def gif(width: int, height: int, rgb: tuple[int, int, int], *, seed: int = 0) -> bytes:
    """A GIF89a of random pixels from ``seed`` in a 4-colour palette whose
    first colour is ``rgb``. Its LZW stream sends a clear code before every
    pixel code table could grow, so every code has the same 3-bit width: no
    compression, but a valid stream any decoder reads."""
    palette = [rgb, (255 - rgb[0], rgb[1], rgb[2]), (rgb[0], 255 - rgb[1], rgb[2]), (0, 0, 255 - rgb[2])]
    pixels = np.random.default_rng(seed).integers(0, 4, width * height)
    min_size, clear, end = 2, 4, 5
    codes: list[int] = []
    for i, px in enumerate(pixels):
        if i % 2 == 0:
            codes.append(clear)  # before the table's next entry would need 4 bits
        codes.append(int(px))
    codes.append(end)
    bits = 0
    n_bits = 0
    out = bytearray()
    for code in codes:
        bits |= code << n_bits
        n_bits += 3
        while n_bits >= 8:
            out.append(bits & 0xFF)
            bits >>= 8
            n_bits -= 8
    if n_bits:
        out.append(bits & 0xFF)
    blocks = b"".join(bytes([len(out[i:i + 255])]) + bytes(out[i:i + 255]) for i in range(0, len(out), 255))
    screen = struct.pack("<HHBBB", width, height, 0x81, 0, 0)  # global table of 4 colours
    table = b"".join(bytes(c) for c in palette)
    image = b"," + struct.pack("<HHHHB", 0, 0, width, height, 0)
    return b"GIF89a" + screen + table + image + bytes([min_size]) + blocks + b"\x00;"
