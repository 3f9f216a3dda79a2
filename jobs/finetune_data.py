"""Chat JSONL -> token ids with labels on assistant tokens only.

Each row is rendered with the model's chat template. Which characters are
the assistant's is found by rendering prefixes of the conversation: the
text that ``messages[:i+1]`` adds over ``messages[:i]`` plus the generation
prompt is the i-th (assistant) message as the template writes it, closing
tokens included, so the model also learns to stop. Token offsets from the
fast tokenizer then turn those character spans into a label mask.

Batches are drawn from a seeded permutation per epoch, as one continuous
stream of micro-batches: optimizer step ``s`` always reads the same
micro-batches, so a resumed run sees exactly the data it would have seen.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.context import JobError

if TYPE_CHECKING:
    import torch

IGNORE = -100
# Used when the base model has no chat template of its own.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]

    @property
    def n_labels(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE)


@dataclass
class Encoded:
    examples: list[Example]
    skipped: int
    truncated: int


def read_chat_jsonl(path: Path) -> list[Messages]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                msgs = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise JobError(f"{path.name} line {n}: not a chat row ({exc}); run a dataset job first") from exc
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise JobError(f"{path.name} line {n}: messages must be a list of objects")
            rows.append(msgs)
    if not rows:
        raise JobError(f"{path.name} has no rows")
    return rows


def _render(tokenizer: Any, msgs: Messages, gen_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)
    return str(text)


def assistant_spans(tokenizer: Any, msgs: Messages) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of assistant turns."""
    full = _render(tokenizer, msgs, False)
    spans = []
    for i, m in enumerate(msgs):
        if m.get("role") != "assistant":
            continue
        before = _render(tokenizer, msgs[:i], True) if i else ""
        upto = _render(tokenizer, msgs[: i + 1], False)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise JobError(
                "the chat template does not render conversations prefix by prefix, so assistant "
                "tokens cannot be located; use a model whose template does"
            )
        spans.append((len(before), len(upto)))
    return full, spans


def encode(tokenizer: Any, msgs: Messages, max_len: int) -> tuple[Example | None, bool]:
    """(example or None when no assistant token survives, truncated?)."""
    text, spans = assistant_spans(tokenizer, msgs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    bos = tokenizer.bos_token_id
    offsets = list(enc["offset_mapping"])
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and (not ids or ids[0] != bos):
        # Templates that do not write BOS themselves rely on the tokenizer.
        ids, offsets = [bos, *ids], [(0, 0), *offsets]
    labels = [tid if any(a <= s < b for a, b in spans) and e > s else IGNORE
              for tid, (s, e) in zip(ids, offsets)]
    truncated = len(ids) > max_len
    ids, labels = ids[:max_len], labels[:max_len]
    if all(x == IGNORE for x in labels[1:]):
        return None, truncated
    return Example(ids, labels), truncated


def encode_all(tokenizer: Any, rows: list[Messages], max_len: int) -> Encoded:
    out = Encoded([], 0, 0)
    for msgs in rows:
        ex, truncated = encode(tokenizer, msgs, max_len)
        out.truncated += truncated
        if ex is None:
            out.skipped += 1
        else:
            out.examples.append(ex)
    return out


@dataclass(frozen=True)
class Schedule:
    """Which examples each optimizer step reads (a pure function of the step).

    With ``world`` data-parallel ranks an optimizer step reads ``accum *
    world`` micro-batches of the one seeded stream; rank ``r`` takes every
    ``world``-th of them, starting at its own. One rank reads exactly what
    the single-process loop reads.
    """

    n_examples: int
    batch_size: int
    accum: int
    seed: int
    world: int = 1

    @property
    def micro_per_epoch(self) -> int:
        return math.ceil(self.n_examples / self.batch_size)

    @property
    def micro_per_step(self) -> int:
        return self.accum * self.world

    def total_steps(self, epochs: float, max_steps: int | None) -> int:
        if max_steps is not None:
            return max_steps
        return max(1, math.ceil(epochs * self.micro_per_epoch / self.micro_per_step))

    def epoch_at(self, step: int) -> float:
        """Epochs completed after ``step`` optimizer steps."""
        return round(step * self.micro_per_step / self.micro_per_epoch, 4)

    def micro_batches(self, step: int) -> list[list[int]]:
        """Example indices of every micro-batch of optimizer step ``step``
        (0-based), all ranks' together: rank ``r`` reads ``[r::world]``."""
        import torch

        out = []
        per = self.micro_per_step
        orders: dict[int, list[int]] = {}
        for m in range(step * per, (step + 1) * per):
            epoch, pos = divmod(m, self.micro_per_epoch)
            if epoch not in orders:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                orders[epoch] = torch.randperm(self.n_examples, generator=gen).tolist()
            out.append(orders[epoch][pos * self.batch_size : (pos + 1) * self.batch_size])
        return out


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
