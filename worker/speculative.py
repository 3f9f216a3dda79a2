"""Speculative decoding as the worker runs it: the mode, its draft model and
draft lengths, their worker arguments, and the engine parameters they set.

The parent decides the mode (``auto`` is resolved there, against the model
library); a worker only applies one of ``off``, ``draft``, ``mtp`` and
``ngram``. Drafting is the engine's own (llama.cpp's speculative decoding):
with greedy sampling the target model verifies every drafted token, so the
text is the same as without drafting, only the speed differs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import xllamacpp

Mode = Literal["off", "draft", "mtp", "ngram"]
MODES: tuple[Mode, ...] = ("off", "draft", "mtp", "ngram")
_TYPE = xllamacpp.common_speculative_type
_ENGINE_TYPES = {
    "draft": _TYPE.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE,
    "mtp": _TYPE.COMMON_SPECULATIVE_TYPE_DRAFT_MTP,
    "ngram": _TYPE.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE,
}


@dataclass(frozen=True)
class SpeculativeOptions:
    mode: Mode = "off"
    # The draft model's GGUF (mode "draft" only).
    draft_model: str = ""
    # Tokens drafted per step; 0 = the engine's default.
    draft_min: int = 0
    draft_max: int = 0

    def argv(self) -> list[str]:
        """The worker arguments that carry these options."""
        if self.mode == "off":
            return []
        args = ["--speculative", self.mode]
        if self.draft_model:
            args += ["--draft-model", self.draft_model]
        if self.draft_min:
            args += ["--draft-min", str(self.draft_min)]
        if self.draft_max:
            args += ["--draft-max", str(self.draft_max)]
        return args

    def load_note(self) -> str:
        """What a load failure message adds: the engine reports a failed draft
        like a failed model (its log names which)."""
        if self.mode == "draft":
            return f" with the draft model {Path(self.draft_model).name}"
        if self.mode == "mtp":
            return " with its MTP layers"
        return ""

    def apply(self, p: xllamacpp.CommonParams, n_gpu_layers: int) -> None:
        """Set the engine's speculative parameters (nothing when off)."""
        if self.mode == "off":
            return
        p.speculative.types = [_ENGINE_TYPES[self.mode]]
        if self.mode == "ngram":
            # Prompt lookup drafts up to size_m tokens after a match of the last size_n.
            if self.draft_max:
                p.speculative.ngram_simple.size_m = self.draft_max
            return
        draft = p.speculative.draft
        if self.draft_min:
            draft.n_min = self.draft_min
        if self.draft_max:
            draft.n_max = self.draft_max
        if self.mode == "mtp":
            # The MTP head lives in the target's own file; loading it is opt-in.
            p.load_mtp = True
            return
        draft.mparams.path = self.draft_model
        # The draft sits where the target does: all on the GPU, or all on the CPU.
        draft.n_gpu_layers = -1 if n_gpu_layers != 0 else 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--speculative", default="off", choices=list(MODES))
    ap.add_argument("--draft-model", default="", help="the draft model's GGUF (with --speculative draft)")
    ap.add_argument("--draft-min", type=int, default=0)
    ap.add_argument("--draft-max", type=int, default=0)
    # The older spelling of "--speculative ngram --draft-max N".
    ap.add_argument("--draft-ngram", type=int, default=0)


def from_args(args: argparse.Namespace) -> SpeculativeOptions:
    if args.draft_ngram > 0 and args.speculative == "off":
        return SpeculativeOptions("ngram", draft_max=args.draft_ngram)
    return SpeculativeOptions(args.speculative, args.draft_model, args.draft_min, args.draft_max)
