"""A tiny random-weight audio model pair: a text GGUF and its mmproj GGUF.

The projector is Qwen2-Audio style (``clip.projector_type = "qwen2a"``): a
whisper encoder (two 1-D convolutions over the log-mel spectrogram, the
second with stride 2, then pre-norm transformer blocks whose key projection
has no bias, then an average pool of 2) and one linear layer into the text
model's embedding space. The engine decodes WAV, MP3 or FLAC, mixes to mono,
resamples to 16 kHz and computes the mel filters itself (none are stored in
the file). It appends 30 s of silence and cuts the spectrogram (10 ms hop)
into whole 3000-frame windows, each ``3000 / 2 / 2 = 750`` embeddings, so a
clip under about 30 s takes 750 positions (see ``audio_positions``), plus
the text of the ``<|audio_bos|>`` and ``<|audio_eos|>`` markers the engine
puts around it (plain text to this vocab: 14 tokens each). Tensor names and
header keys follow llama.cpp's clip loader; numpy shapes are (ne1, ne0, ...),
rows first, as gguf stores them. Weights are random, so outputs are
gibberish, but deterministic under greedy decoding and dependent on the
audio's samples.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np

from supervisor.models.demo import finish_gguf
from tests.tiny_vision import (
    TEXT_EMBD,
    add_encoder_blocks,
    clip_writer,
    ones,
    write_tiny_text_model,
    zeros,
)

# The engine's audio rate and mel hop (samples).
SAMPLE_RATE = 16000
HOP = 160
# Mel frames in one encoder window (30 s); the positional table must cover
# the window after the stride-2 convolution.
WINDOW_FRAMES = 3000
# Embeddings one window becomes.
POSITIONS_PER_WINDOW = WINDOW_FRAMES // 2 // 2


def audio_positions(n_samples: int) -> int:
    """Embeddings the engine makes of ``n_samples`` samples at 16 kHz (as
    measured: 479839 samples are one window, 479840 two)."""
    return POSITIONS_PER_WINDOW * (1 + (n_samples // HOP + 1) // WINDOW_FRAMES)


def write_tiny_audio_mmproj(
    path: Path,
    *,
    seed: int = 0,
    text_embd: int = TEXT_EMBD,
    n_mel: int = 80,
    n_embd: int = 32,
    n_head: int = 2,
    n_ff: int = 48,
    n_layer: int = 2,
) -> Path:
    """Write a random qwen2a-style audio mmproj (F32) whose output is ``text_embd`` wide."""
    rng = np.random.default_rng(seed)
    n_pos = WINDOW_FRAMES // 2
    tmp = path.with_name(path.name + ".tmp")
    w = clip_writer(tmp, "tiny-random-audio-mmproj", "audio", "qwen2a", n_embd=n_embd, n_ff=n_ff,
                    n_layer=n_layer, n_head=n_head, text_embd=text_embd, eps=1e-5)
    w.add_uint32("clip.audio.num_mel_bins", n_mel)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    # Conv kernels ne = [kernel, in_channels, out_channels]; their biases are
    # ne = [1, out_channels] so they broadcast over the frames.
    w.add_tensor("a.conv1d.1.weight", rand(n_embd, n_mel, 3))
    w.add_tensor("a.conv1d.1.bias", zeros(n_embd, 1))
    w.add_tensor("a.conv1d.2.weight", rand(n_embd, n_embd, 3))
    w.add_tensor("a.conv1d.2.bias", zeros(n_embd, 1))
    w.add_tensor("a.position_embd.weight", rand(n_pos, n_embd))
    add_encoder_blocks(w, rand, "a", n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, key_bias=False)
    w.add_tensor("a.post_ln.weight", ones(n_embd))
    w.add_tensor("a.post_ln.bias", zeros(n_embd))
    w.add_tensor("mm.a.fc.weight", rand(text_embd, n_embd))
    w.add_tensor("mm.a.fc.bias", zeros(text_embd))
    return finish_gguf(w, tmp, path)


def write_tiny_audio_pair(models_dir: Path, *, seed: int = 0) -> tuple[Path, Path]:
    """The text model and its audio projector, in ``models_dir``."""
    text = write_tiny_text_model(models_dir / "tiny-audio.gguf", seed=seed)
    mmproj = write_tiny_audio_mmproj(models_dir / "mmproj-tiny-audio.gguf", seed=seed, text_embd=TEXT_EMBD)
    return text, mmproj


def wav(seconds: float, freq_hz: float, *, sample_rate: int = SAMPLE_RATE, seed: int = 0) -> bytes:
    """A 16-bit PCM mono WAV: a sine at ``freq_hz``, or white noise from
    ``seed`` when ``freq_hz`` is 0."""
    n = round(seconds * sample_rate)
    if freq_hz > 0:
        signal = 0.5 * np.sin(2 * np.pi * freq_hz * np.arange(n) / sample_rate)
    else:
        signal = np.random.default_rng(seed).uniform(-0.5, 0.5, n)
    pcm = (signal * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())
    return buf.getvalue()
