"""The quantizer's reference data: llama.cpp's own outputs, stored as digests.

``tests/fixtures/quantize/reference.json`` holds, for tiny random models that
:func:`supervisor.models.demo.write_tiny_gguf` regenerates from a seed, what
llama.cpp's ``llama_model_quantize`` wrote for each type: every tensor's name,
ggml type and the sha256 of its bytes, and the sha256 of the whole file.
``tests/fixtures/quantize/make_reference.py`` made it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from supervisor.models.demo import write_tiny_gguf

FIXTURE = Path(__file__).parent / "fixtures" / "quantize" / "reference.json"

# Loads a GGUF with xllamacpp and generates a few tokens; its HTTP listener
# goes on a Unix socket in a private folder, never on TCP.
LOAD_AND_GENERATE = textwrap.dedent(
    """
    import os, sys, tempfile
    import xllamacpp as x
    p = x.CommonParams()
    p.model.path = sys.argv[1]
    p.n_ctx = 128
    p.cpuparams.n_threads = 1
    p.cpuparams_batch.n_threads = 1
    p.warmup = False
    with tempfile.TemporaryDirectory() as d:
        p.hostnames = [os.path.join(d, "e.sock")]
        s = x.Server(p)
        r = s.handle_completions(
            {"prompt": "hello", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True})
        del s
    print(r["usage"]["completion_tokens"])
    """
)


def generated_tokens(path: Path, timeout: float = 60) -> int:
    """Load ``path`` in a fresh interpreter and return how many tokens it generated."""
    gen = subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, str(path)],
                         capture_output=True, timeout=timeout, check=False)
    assert gen.returncode == 0, gen.stderr.decode(errors="replace")[-2000:]
    return int(gen.stdout.split()[-1])


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tensor_digests(path: Path) -> list[list[str]]:
    """[name, ggml type, sha256 of the bytes] for each tensor, in file order."""
    reader = gguf.GGUFReader(str(path))
    out = []
    for t in reader.tensors:
        start = int(t.data_offset)
        data = reader.data[start: start + int(t.n_bytes)]
        out.append([str(t.name), gguf.GGMLQuantizationType(int(t.tensor_type)).name,
                    hashlib.sha256(data.tobytes()).hexdigest()])
    return out


@dataclass(frozen=True)
class Case:
    """One reference output: ``model`` quantized to ``type``, from its ``source`` output if set."""

    model: str
    type: str
    source: str | None
    file_sha256: str
    tensors: list[list[str]]

    @property
    def id(self) -> str:
        return f"{self.model}-{self.source}-{self.type}" if self.source else f"{self.model}-{self.type}"


def load_reference() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    return data


def cases(reference: dict[str, Any]) -> list[Case]:
    return [Case(c["model"], c["type"], c.get("source"), c["file_sha256"], c["tensors"])
            for c in reference["cases"]]


def write_model(directory: Path, name: str, args: dict[str, int]) -> Path:
    """Regenerate the reference input ``name`` from its recorded arguments."""
    return write_tiny_gguf(directory / f"{name}.gguf", seed=args["seed"], n_embd=args["n_embd"],
                           n_ff=args["n_ff"], n_layer=args["n_layer"])

