"""The Codex CLI (``codex exec``) against a real server, offline.

Codex speaks the Responses API with everything it has: a namespace tool
(``multi_agent_v1``), a hosted ``web_search``, ``store: false`` with the
whole history resent, ``include: ["reasoning.encrypted_content"]`` and a
prompt of about 19,000 tokens. It also tries to reach the internet, so it
runs in a private network namespace (``unshare -n``) with only a loopback
interface, and the service runs inside the same namespace. One turn must
complete, and a second one resumed from it (``codex exec resume --last``).

The CLI comes from npm (``@openai/codex``, which ships its binary), installed
into ``.venv/codex`` by ``.ci/run``; without it, or without the right to
create a network namespace, the test is skipped and says why.

The tiny random model would write until its context is full (Codex sets no
output limit), so the one served here has its end-of-sequence token made far
more likely: replies stay a few tokens long and the turn time is the prompt's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import pytest

from supervisor.models.demo import write_tiny_gguf
from tests.real_templates import TEMPLATES
from tests.server import REPO, Server, running, short_tempdir

CODEX = REPO / ".venv" / "codex" / "node_modules" / ".bin" / "codex"
# Codex's own prompt is about 19,000 tokens with this tokenizer; room for two turns.
N_CTX = 131072  # Codex sends about a dozen tools: long prompts on a tiny vocab
TURN_TIMEOUT_S = 150

pytestmark = pytest.mark.timeout(2 * TURN_TIMEOUT_S + 60)


def codex_binary() -> str | None:
    if CODEX.exists():
        return str(CODEX)
    return shutil.which("codex")


def brief_tiny_model(path: Path) -> Path:
    """A tiny random model whose replies end soon: the output row of its
    end-of-sequence token is scaled up, so that token's logit dominates often."""
    # Qwen 2.5's template, whose own (Hermes) tool format the parser reads:
    # Codex always sends tools, and with the demo's plain ChatML they would
    # go the generic JSON way, where a random model's answer is a JSON string
    # it hardly ever closes, so no turn would end.
    template = (TEMPLATES / "qwen2.5-instruct.jinja").read_text()
    write_tiny_gguf(path, n_ctx=N_CTX, n_layer=1, n_head=2, n_head_kv=1, chat_template=template)
    reader = gguf.GGUFReader(str(path), mode="r+")
    eos = int(reader.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    output = next(t for t in reader.tensors if t.name == "output.weight")
    output.data[eos] *= 3.0
    reader.data.flush()
    return path


CONFIG = """\
model = "tiny"
model_provider = "gpuvisor"

[model_providers.gpuvisor]
name = "gpuvisor"
base_url = "{base_url}/v1"
wire_api = "responses"
"""


def _turn(codex: str, args: list[str], work: Path) -> dict[str, Any]:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(work), "CODEX_HOME": str(work / "home")}
    started = time.monotonic()
    proc = subprocess.run([codex, "exec", "--skip-git-repo-check", *args], cwd=work / "project", env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TURN_TIMEOUT_S,
                          check=False)
    output = proc.stdout + proc.stderr
    used = re.search(r"tokens used\s+([\d,]+)", output)
    return {"rc": proc.returncode, "output": output[-6000:], "seconds": round(time.monotonic() - started, 1),
            "tokens": int(used.group(1).replace(",", "")) if used else None}


def inside(work_dir: str) -> None:
    """Run in the private network namespace: the service, then two Codex turns."""
    work = Path(work_dir)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    models = work / "models"
    models.mkdir()
    brief_tiny_model(models / "tiny.gguf")
    (work / "project").mkdir()
    (work / "home").mkdir()
    env = {"GPUVISOR_N_CTX": str(N_CTX), "GPUVISOR_PARALLEL": "1",
           "GPUVISOR_N_THREADS": str(min(4, os.cpu_count() or 1))}
    codex = codex_binary()
    assert codex is not None
    results: dict[str, Any] = {}
    with running(Server(models, state_dir=short_tempdir("gvx"), env=env, model="tiny")) as server:
        (work / "home" / "config.toml").write_text(CONFIG.format(base_url=server.base_url))
        results["first"] = _turn(codex, ["Say hi."], work)
        results["resumed"] = _turn(codex, ["resume", "--last", "Again."], work)
        results["log"] = server.log_text()[-8000:]
    (work / "results.json").write_text(json.dumps(results))


def _namespace_problem() -> str | None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip (util-linux, iproute2) is not installed"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"creating a network namespace is not permitted here: {probe.stderr.strip()}"
    return None


def _session() -> dict[str, Any]:
    """The service and two Codex turns in a private network namespace."""
    work = short_tempdir("gvcx")
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        script = f"from tests.test_clients_codex import inside; inside({str(work)!r})"
        proc = subprocess.run(["unshare", "-n", sys.executable, "-c", script], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=2 * TURN_TIMEOUT_S + 45, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return dict(json.loads((work / "results.json").read_text()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_codex_exec_completes_a_turn_and_a_resumed_one() -> None:
    if codex_binary() is None:
        pytest.skip("the Codex CLI is not installed (npm install --prefix .venv/codex @openai/codex)")
    problem = _namespace_problem()
    if problem is not None:
        pytest.skip(problem)
    results = _session()
    first, resumed = results["first"], results["resumed"]
    assert first["rc"] == 0, first["output"] + results["log"]
    assert resumed["rc"] == 0, resumed["output"] + results["log"]
    # Each turn is one streamed response; the resumed one carries the first turn too.
    # The CLI may close the connection as soon as it has response.completed,
    # before the handler ends: a stream that had started is still logged 200.
    requests = re.findall(r"POST /v1/responses (\d{3})", results["log"])
    assert requests == ["200", "200"], resumed["output"] + results["log"]
    assert first["tokens"] and first["tokens"] > 10_000, first["output"]
    assert resumed["tokens"] and resumed["tokens"] > first["tokens"], (first, resumed)
    print(f"codex: {first['tokens']} tokens in {first['seconds']} s, resumed {resumed['tokens']} "
          f"tokens in {resumed['seconds']} s")
