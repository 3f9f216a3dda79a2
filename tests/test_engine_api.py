"""The engine interface (worker/engine_api.py): a llama.cpp worker serves
through it, its entry point imports no engine, ``--engine`` picks one by
name (an unknown one is a load failure, exit 3), and the engine's refusals
come back typed by what the request carried."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server import REPO
from tests.tiny_vision import png, write_tiny_vision_pair
from tests.worker_harness import spawn_worker, start_worker
from worker import engine_api
from worker import protocol as p
from worker.engine_api import LoadError, UnknownEngine, loader

RED = png(32, 32, (255, 0, 0))
# A PNG signature and a sound IHDR (so the header checks pass), then nothing
# a decoder can read: only the engine finds it broken.
CORRUPT = RED[:33] + b"\x00" * 64
JSON_GRAMMAR = 'root ::= "{" [a-z]* "}"'
BROKEN_GRAMMAR = "root ::= undefined-rule"


@pytest.fixture(scope="module")
def vision_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_vision_pair(tmp_path_factory.mktemp("vision"))


def _look(*parts: p.ContentPart) -> list[p.ChatMessage]:
    return [p.ChatMessage("user", parts=list(parts))]


async def test_a_llamacpp_worker_serves_through_the_interface_without_torch(
        vision_pair: tuple[Path, Path]) -> None:
    model, mmproj = vision_pair
    async with spawn_worker(model, "--engine", "llamacpp", "--mmproj", str(mmproj)) as (w, hello):
        assert hello.facts.vision and hello.facts.n_ctx == 512
        text, done = await w.generate(messages=_look(p.TextPart("look: "), p.ImagePart(), p.TextPart("!")),
                                      images=[RED])
        assert isinstance(done, p.Done) and done.completion_tokens == 12 and text
        w.writer.write(w.codec.encode(p.Tokenize(99, "hello world")))
        tokens = await w.next_msg()
        assert isinstance(tokens, p.Tokens) and tokens.id == 99 and tokens.tokens
        # The shared libraries the running worker has mapped: the engine's,
        # and nothing of torch's (vLLM needs torch, so none of vLLM's either).
        maps = Path(f"/proc/{w.proc.pid}/maps").read_text()
        assert "xllamacpp" in maps
        assert "torch" not in maps and "vllm" not in maps


async def test_refusals_are_typed_by_what_the_request_carried(vision_pair: tuple[Path, Path]) -> None:
    model, mmproj = vision_pair
    one = _look(p.TextPart("x"), p.ImagePart(), p.TextPart("y"))
    under = p.SamplingParams(max_tokens=4, temperature=0.0, grammar=JSON_GRAMMAR)
    broken = p.SamplingParams(max_tokens=4, temperature=0.0, grammar=BROKEN_GRAMMAR)
    async with spawn_worker(model, "--mmproj", str(mmproj)) as (w, _):
        cases: list[tuple[dict[str, object], str]] = [
            ({"messages": one, "images": [CORRUPT]}, "invalid_image"),
            # Media and a grammar: the engine is asked about the grammar alone.
            ({"messages": one, "images": [CORRUPT], "params": under}, "invalid_image"),
            ({"messages": one, "images": [RED], "params": broken}, "invalid_grammar"),
            ({"messages": one, "images": [CORRUPT], "params": broken}, "invalid_grammar"),
            ({"prompt": "x", "params": broken}, "invalid_grammar"),
            ({"prompt": "many words " * 400}, "context_length_exceeded"),
        ]
        for fields, code in cases:
            _, end = await w.generate(**fields)
            assert isinstance(end, p.Error) and end.code == code, (fields.get("params"), code, end)
        text, done = await w.generate(messages=one, images=[RED], params=under)
        assert isinstance(done, p.Done) and text.startswith("{"), text


def test_the_worker_entry_imports_no_engine() -> None:
    # What `python -m worker` imports before it has connected, beyond the
    # standard library: msgspec (the protocol; it takes typing_extensions
    # where installed) only, so a worker environment of its own needs nothing
    # of the parent's, nor of any engine.
    code = ("import json, sys\n"
            "before = set(sys.modules)\n"
            "import worker.__main__ as entry, worker.server\n"
            "entry.parse_args(['--socket', 's', '--model', 'm', '--engine', 'other'])\n"
            "tops = {m.split('.')[0] for m in set(sys.modules) - before}\n"
            "print(json.dumps(sorted(tops - set(sys.stdlib_module_names))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)) <= {"msgspec", "typing_extensions", "worker", "formats"}, out.stdout


def test_help_names_the_engines() -> None:
    out = subprocess.run([sys.executable, "-m", "worker", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "--engine" in out.stdout and "llamacpp" in out.stdout


async def test_an_unknown_engine_is_a_load_failure_with_exit_3(tiny_model_path: Path) -> None:
    async with start_worker(tiny_model_path, "--engine", "nosuch") as (w, first):
        assert isinstance(first, p.LoadFailed), first
        assert "unknown engine 'nosuch'" in first.reason and "llamacpp" in first.reason
        assert await asyncio.wait_for(w.proc.wait(), 30) == p.EXIT_LOAD_FAILED


def test_an_engine_whose_library_is_missing_is_a_load_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_api, "ENGINES", {"ghost": "worker.engine_ghost_not_installed"})
    with pytest.raises(LoadError) as missing:
        loader("ghost")
    assert not isinstance(missing.value, UnknownEngine)
    assert "ghost engine cannot be imported" in str(missing.value)
    with pytest.raises(UnknownEngine):
        loader("llamacpp")  # not in the registry patched above


def test_the_default_engine_is_llamacpp_loaded_from_its_module() -> None:
    import worker.engine

    assert engine_api.DEFAULT_ENGINE == "llamacpp"
    assert loader("llamacpp") is worker.engine.load
