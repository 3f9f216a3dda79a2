"""Export from a crafted Hugging Face dir fails with a clear job error, in
bounded time and memory: counts in config.json and ids in tokenizer.json
are bounded by what the files hold, hyperparameters are checked before
anything divides by them, and no file is read through a link out of the
model dir (a hub snapshot's links into its blobs excepted).

Each conversion runs in a child process under an address-space limit, so a
loop sized by a crafted number fails the test instead of the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the train extra")

from tests.tiny_hf import build_tiny_model

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parent.parent
LIMIT = 3 << 30  # address space of the child: far below what the crafted numbers would take
_CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from pathlib import Path
from jobs.context import JobError
from jobs.hf_convert import convert
try:
    convert(Path(sys.argv[1]), Path(sys.argv[2]), "F32", "t")
    outcome = {{"ok": True}}
except JobError as exc:
    outcome = {{"ok": False, "error": str(exc)}}
outcome["peak_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(outcome))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("bounds") / "tiny-hf")


def _convert(model_dir: Path, out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD.format(limit=LIMIT), str(model_dir), str(out)],
                          capture_output=True, text=True, timeout=60, env=env, check=False, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    # Far below the limit: nothing was sized by the crafted numbers.
    assert outcome["peak_kib"] < 1 << 20, outcome
    return outcome


def _copy(tiny: Path, tmp_path: Path, name: str = "m") -> Path:
    return Path(shutil.copytree(tiny, tmp_path / name))


def _edit(path: Path, change: Any) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _refused(model_dir: Path, tmp_path: Path, *words: str) -> str:
    outcome = _convert(model_dir, tmp_path / "out.gguf")
    assert not outcome["ok"], outcome
    assert all(w in outcome["error"] for w in words), outcome
    return str(outcome["error"])


def test_the_tiny_model_converts_within_the_limit(tiny: Path, tmp_path: Path) -> None:
    assert _convert(tiny, tmp_path / "out.gguf")["ok"]


@pytest.mark.parametrize(("key", "value", "words"), [
    ("vocab_size", 2e9, ("vocab_size", "outside")),
    # Within the bound on any config, but far more rows than the tokenizer's 320 tokens.
    ("vocab_size", 1_000_000, ("vocab_size", "320 tokens")),
    ("num_hidden_layers", 1e9, ("num_hidden_layers",)),
    ("num_attention_heads", 0, ("num_attention_heads",)),
    ("num_key_value_heads", 3, ("num_key_value_heads", "multiple")),
    ("hidden_size", "64", ("hidden_size", "whole number")),
    ("rms_norm_eps", float("nan"), ("rms_norm_eps",)),
])
def test_a_crafted_config_value_is_a_clear_error(tiny: Path, tmp_path: Path, key: str, value: Any,
                                                 words: tuple[str, ...]) -> None:
    model = _copy(tiny, tmp_path)
    _edit(model / "config.json", lambda cfg: cfg.__setitem__(key, value))
    _refused(model, tmp_path, *words)


def test_heads_that_do_not_divide_the_width_are_a_clear_error(tiny: Path, tmp_path: Path) -> None:
    model = _copy(tiny, tmp_path)

    def change(cfg: dict[str, Any]) -> None:
        cfg.pop("head_dim")
        cfg["num_attention_heads"], cfg["num_key_value_heads"] = 3, 3
    _edit(model / "config.json", change)
    _refused(model, tmp_path, "hidden_size", "num_attention_heads")


def test_a_huge_token_id_is_a_clear_error(tiny: Path, tmp_path: Path) -> None:
    for where in ("added", "vocab"):
        model = _copy(tiny, tmp_path, where)

        def change(tok: dict[str, Any], where: str = where) -> None:
            if where == "added":
                tok["added_tokens"][0]["id"] = 2_000_000_000
            else:
                tok["model"]["vocab"]["zzz-crafted"] = 2_000_000_000
        _edit(model / "tokenizer.json", change)
        _refused(model, tmp_path, "tokenizer.json", "2000000000")


def test_a_negative_or_non_numeric_token_id_is_a_clear_error(tiny: Path, tmp_path: Path) -> None:
    model = _copy(tiny, tmp_path)
    _edit(model / "tokenizer.json", lambda tok: tok["added_tokens"][0].__setitem__("id", -5))
    _refused(model, tmp_path, "token id -5")


def test_a_file_linked_out_of_the_model_dir_is_not_read(tiny: Path, tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere" / "config.json"
    secret.parent.mkdir()
    shutil.copy(tiny / "config.json", secret)
    model = _copy(tiny, tmp_path)
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(secret)
    _refused(model, tmp_path, "config.json", "outside the model dir")

    # A shard index naming a file above the dir.
    model = _copy(tiny, tmp_path, "indexed")
    shutil.move(model / "model.safetensors", tmp_path / "above.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../above.safetensors"}}))
    _refused(model, tmp_path, "../above.safetensors", "not a file name inside the model dir")


def test_a_hub_snapshot_linking_into_its_blobs_converts(tiny: Path, tmp_path: Path) -> None:
    repo = tmp_path / "models--someone--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(tiny.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    assert _convert(snapshot, tmp_path / "out.gguf")["ok"]
