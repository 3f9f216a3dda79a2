"""Our request fields as vLLM's, and vLLM's outputs as ours (the vLLM engine,
worker/engine_vllm.py). Imported only by a worker started with ``--engine vllm``.

Sampling is mapped field by field (``repeat_penalty`` is vLLM's
``repetition_penalty``; ``top_k`` 0 means no cut in both). Output formats go
to vLLM's structured outputs: a JSON schema as ``json``, any JSON object as
``json_object``, a grammar as ``grammar`` (vLLM's backends read GBNF-style
EBNF). Log-probabilities are of the raw logits (vLLM's default
``logprobs_mode``), as the llama.cpp engine reports them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

from vllm.config.lora import MaxLoRARanks
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.sampling_params import SamplingParams as VllmSampling

from worker.protocol import SamplingParams, TokenLogprob, TopLogprob

# The most alternatives per position a request may ask for (vLLM's max_logprobs).
MAX_LOGPROBS = 20
# vLLM takes top_p in (0, 1]; ours (OpenAI's) may be 0, which keeps the most
# likely token only: so does the smallest positive share.
TOP_P_ONLY_TOP = 1e-9


class ConstraintError(ValueError):
    """The output constraint cannot be built (the request's ``invalid_grammar``)."""


def structured(params: SamplingParams) -> StructuredOutputsParams | None:
    """The output constraint, or None. Raises :class:`ConstraintError` for a
    schema that is not JSON or one vLLM refuses."""
    try:
        if params.grammar:
            return StructuredOutputsParams(grammar=params.grammar)
        if params.json_schema:
            return StructuredOutputsParams(json=json.loads(params.json_schema))
        if params.json_object:
            return StructuredOutputsParams(json_object=True)
    except (ValueError, VLLMClientError) as exc:  # VLLMValidationError is no ValueError
        raise ConstraintError(str(exc)) from exc
    return None


def sampling(params: SamplingParams, *, max_tokens: int, stops: list[str]) -> Any:
    """vLLM's SamplingParams for one request, streaming deltas. Raises
    :class:`ConstraintError` for its output constraint, and vLLM's
    ``VLLMValidationError`` for a value it does not take (a ``repeat_penalty``
    of 0: vLLM needs it > 0)."""
    return VllmSampling(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p if params.top_p > 0 else TOP_P_ONLY_TOP,
        top_k=max(0, params.top_k),
        min_p=params.min_p,
        repetition_penalty=params.repeat_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed,
        stop=stops or None,
        ignore_eos=params.ignore_eos,
        max_tokens=max_tokens,
        logprobs=None if params.logprobs is None else min(params.logprobs, MAX_LOGPROBS),
        structured_outputs=structured(params),
        output_kind=RequestOutputKind.DELTA,
    )


def _piece(text: str | None) -> tuple[str, list[int]]:
    token = text or ""
    return token, list(token.encode("utf-8", errors="replace"))


def _top(lp: Any) -> TopLogprob:
    token, raw = _piece(lp.decoded_token)
    return TopLogprob(token, float(lp.logprob), raw)


def logprobs(token_ids: list[int], positions: Any, top: int) -> list[TokenLogprob]:
    """Ours from vLLM's: per generated token a dict of token id -> Logprob
    holding the ``top`` most likely (ranks 1..top) and the chosen one."""
    out: list[TokenLogprob] = []
    for chosen, alternatives in zip(token_ids, positions or [], strict=False):
        mine = alternatives.get(chosen)
        token, raw = _piece(mine.decoded_token if mine is not None else "")
        ranked = sorted((lp for lp in alternatives.values() if lp.rank is not None and lp.rank <= top),
                        key=lambda lp: lp.rank)
        out.append(TokenLogprob(token, float(mine.logprob) if mine is not None else 0.0, raw,
                                [_top(lp) for lp in ranked]))
    return out


def lora_rank(adapter_dir: str) -> int:
    """The rank ``r`` of a PEFT adapter dir (its adapter_config.json), 0 when unknown."""
    try:
        config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return 0
    rank = config.get("r") if isinstance(config, dict) else None
    return rank if isinstance(rank, int) and rank > 0 else 0


def max_lora_rank(ranks: list[int]) -> int:
    """vLLM's ``max_lora_rank`` for adapters of ``ranks``: the least it allows
    (16 at least, its default) that holds them all. vLLM takes only a few
    values; an adapter of rank 20 asks for 32, not 20 (which it refuses, and
    the base would not load)."""
    allowed = sorted(int(r) for r in get_args(MaxLoRARanks))
    need = max([16, *ranks])
    return next((r for r in allowed if r >= need), need)  # above all: vLLM says why at load
