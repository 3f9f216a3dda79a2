"""Speculative decoding on the worker's command line: its arguments, read
back into the options (``SpeculativeOptions``, worker/protocol.py, which the
parent writes them from), and what a load failure adds about them.

Engine-free: the llama.cpp parameters these options set are in
worker/engine_params.py. Drafting is the engine's own (llama.cpp's
speculative decoding): with greedy sampling the target model verifies every
drafted token, so the text is the same as without drafting, only the speed
differs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from worker.protocol import SPECULATIVE_MODES, SpeculativeOptions


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--speculative", default="off", choices=list(SPECULATIVE_MODES))
    ap.add_argument("--draft-model", default="", help="the draft model's GGUF (with --speculative draft)")
    ap.add_argument("--draft-min", type=int, default=0)
    ap.add_argument("--draft-max", type=int, default=0)
    # The older spelling of "--speculative ngram --draft-max N".
    ap.add_argument("--draft-ngram", type=int, default=0)


def from_args(args: argparse.Namespace) -> SpeculativeOptions:
    if args.draft_ngram > 0 and args.speculative == "off":
        return SpeculativeOptions("ngram", draft_max=args.draft_ngram)
    return SpeculativeOptions(args.speculative, args.draft_model, args.draft_min, args.draft_max)


def load_note(opts: SpeculativeOptions) -> str:
    """What a load failure message adds: the engine reports a failed draft
    like a failed model (its log names which)."""
    if opts.mode == "draft":
        return f" with the draft model {Path(opts.draft_model).name}"
    if opts.mode == "mtp":
        return " with its MTP layers"
    if opts.mode in ("eagle", "eagle3"):
        return f" with the {opts.mode.upper()} head {Path(opts.draft_model).name}"
    return ""
