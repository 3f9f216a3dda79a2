"""The ``dataset`` kind: any supported file -> canonical chat JSONL, split.

Reads JSONL, a JSON array, CSV/TSV, plain text, or Parquet (with pyarrow),
converts each row to ``{"messages": [...]}``, drops exact duplicates, splits
train/eval with a seeded shuffle and writes both files atomically into the
datasets dir. Bad rows never stop the job: they are counted, and the first
``max_bad_rows`` are reported with their line (or item) numbers.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobs.context import JobContext, JobError, check_stop
from jobs.events import JobIO
from jobs.formats import RowError, detect_format, to_messages
from jobs.params import DatasetParams, JobParams, dataset_outputs

# (line or item number, row or the error that made it unreadable)
Raw = tuple[int, object]
_DETECT_SAMPLE = 50


class _Progress:
    """Rate-limited progress events (a few per second at most)."""

    def __init__(self, io: JobIO, interval: float = 0.25) -> None:
        self.io = io
        self.interval = interval
        self._last = 0.0

    def __call__(self, fraction: float, message: str) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self.io.progress(fraction, message=message)


# ------------------------------------------------------------------ readers


def _read_lines(path: Path, progress: _Progress) -> Iterator[tuple[int, bytes]]:
    size = max(1, path.stat().st_size)
    with path.open("rb") as f:
        for n, line in enumerate(f, start=1):
            if n % 1000 == 0:
                progress(0.7 * f.tell() / size, f"read {n} lines")
            yield n, line


def _jsonl(path: Path, progress: _Progress) -> Iterator[Raw]:
    for n, line in _read_lines(path, progress):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            yield n, RowError(f"invalid JSON: {exc}")


def _text_lines(path: Path, progress: _Progress) -> Iterator[Raw]:
    for n, line in _read_lines(path, progress):
        text = line.decode("utf-8", errors="replace").rstrip("\r\n")
        if text.strip():
            yield n, text


def _json_array(path: Path, progress: _Progress) -> Iterator[Raw]:
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JobError(f"{path.name} is not valid JSON: {exc}") from exc
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise JobError(f"{path.name} must hold a JSON array of rows")
    yield from enumerate(data, start=1)


def _csv(path: Path, progress: _Progress) -> Iterator[Raw]:
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    with path.open("r", encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        if not reader.fieldnames:
            raise JobError(f"{path.name} has no header row")
        for row in reader:
            if None in row:
                yield reader.line_num, RowError("more cells than header columns")
                continue
            yield reader.line_num, {k: v for k, v in row.items() if v not in (None, "")}


def _parquet(path: Path, progress: _Progress) -> Iterator[Raw]:
    try:
        import pyarrow.parquet as pq  # optional dependency
    except ImportError as exc:
        raise JobError("reading Parquet needs pyarrow, which is not installed") from exc
    table = pq.read_table(path)
    yield from enumerate(table.to_pylist(), start=1)


_READERS = {
    ".jsonl": _jsonl, ".ndjson": _jsonl, ".json": _json_array, ".csv": _csv, ".tsv": _csv,
    ".txt": _text_lines, ".text": _text_lines, ".parquet": _parquet,
}


def read_rows(path: Path, progress: _Progress) -> tuple[str, Iterator[Raw]]:
    suffix = path.suffix.lower()
    reader = _READERS.get(suffix)
    if reader is None:
        raise JobError(f"unsupported file type {suffix or '(none)'}; use one of {sorted(_READERS)}")
    return ("item" if suffix in (".json", ".parquet") else "line"), reader(path, progress)


# ------------------------------------------------------------------ conversion


class _Collector:
    def __init__(self, params: DatasetParams, where: str) -> None:
        self.params = params
        self.where = where
        self.rows: list[list[dict[str, str]]] = []
        self.seen: set[bytes] = set()
        self.read = self.bad = self.duplicates = 0
        self.bad_rows: list[dict[str, Any]] = []

    def add_bad(self, n: int, error: str) -> None:
        self.bad += 1
        if len(self.bad_rows) < self.params.max_bad_rows:
            self.bad_rows.append({self.where: n, "error": error})

    def add(self, n: int, row: object, fmt: str) -> None:
        self.read += 1
        if isinstance(row, RowError):
            self.add_bad(n, str(row))
            return
        try:
            msgs = to_messages(row, fmt)
        except RowError as exc:
            self.add_bad(n, str(exc))
            return
        if self.params.dedupe:
            key = hashlib.blake2b(json.dumps(msgs, sort_keys=True).encode(), digest_size=16).digest()
            if key in self.seen:
                self.duplicates += 1
                return
            self.seen.add(key)
        self.rows.append(msgs)


def collect(io: JobIO, params: DatasetParams, path: Path) -> tuple[_Collector, str]:
    progress = _Progress(io)
    where, rows = read_rows(path, progress)
    fmt: str = params.format
    pending: list[Raw] = []
    if fmt == "auto":
        for item in rows:
            pending.append(item)
            if len(pending) >= _DETECT_SAMPLE:
                break
        found = detect_format([r for _, r in pending if not isinstance(r, RowError)])
        if found is None:
            raise JobError("could not detect the format; name it with the format param")
        fmt = found
        io.log(f"detected format: {fmt}")
    col = _Collector(params, where)
    for i, (n, row) in enumerate(_chain(pending, rows)):
        if i % 1000 == 0:
            check_stop(io, f"after {i} rows")
        col.add(n, row, fmt)
    return col, fmt


def _chain(first: list[Raw], rest: Iterator[Raw]) -> Iterator[Raw]:
    yield from first
    yield from rest


# ------------------------------------------------------------------ stats


def _dist(values: list[int]) -> dict[str, float]:
    if not values:
        return {"min": 0, "max": 0, "mean": 0.0, "p50": 0, "p95": 0, "total": 0}
    s = sorted(values)
    return {
        "min": s[0],
        "max": s[-1],
        "mean": round(statistics.fmean(s), 2),
        "p50": s[len(s) // 2],
        "p95": s[min(len(s) - 1, int(len(s) * 0.95))],
        "total": sum(s),
    }


def token_counts(io: JobIO, model_path: str, rows: list[list[dict[str, str]]]) -> list[int]:
    """Tokens per row with the model's own tokenizer (message contents only)."""
    import llama_cpp  # only in the job process

    io.stage("tokenizing")
    llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    counts = []
    progress = _Progress(io)
    for i, msgs in enumerate(rows):
        counts.append(
            sum(len(llm.tokenize(m["content"].encode(), add_bos=False, special=False)) for m in msgs)
        )
        if i % 1000 == 0:
            check_stop(io, f"after tokenizing {i} rows")
            progress(0.7 + 0.2 * i / max(1, len(rows)), f"tokenized {i} rows")
    return counts


def stats(rows: list[list[dict[str, str]]], tokens: list[int] | None) -> dict[str, Any]:
    roles: Counter[str] = Counter(m["role"] for msgs in rows for m in msgs)
    out: dict[str, Any] = {
        "roles": dict(roles),
        "messages_per_row": _dist([len(msgs) for msgs in rows]),
        "chars": _dist([sum(len(m["content"]) for m in msgs) for msgs in rows]),
    }
    if tokens is not None:
        out["tokens"] = _dist(tokens)
    return out


# ------------------------------------------------------------------ output


def split(n: int, ratio: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_eval = round(n * ratio)
    if ratio > 0 and n >= 2:
        n_eval = max(1, min(n_eval, n - 1))
    elif n < 2:
        n_eval = 0
    return order[n_eval:], order[:n_eval]


def write_jsonl(path: Path, rows: list[list[dict[str, str]]], order: list[int], job_id: str) -> None:
    tmp = path.with_name(f".{path.name}.{job_id}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for i in order:
                f.write(json.dumps({"messages": rows[i]}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def run(io: JobIO, params: JobParams, ctx: JobContext) -> dict[str, Any]:
    if not isinstance(params, DatasetParams) or params.output_name is None:
        raise JobError("dataset needs resolved DatasetParams")
    path = Path(params.input)
    io.stage("reading")
    col, fmt = collect(io, params, path)
    io.log(f"{col.read} rows read, {col.bad} bad, {col.duplicates} duplicates")
    if not col.rows:
        raise JobError(f"no usable rows in {path.name} ({col.bad} bad)")
    tokens = token_counts(io, params.model, col.rows) if params.model else None
    check_stop(io, "before writing")
    io.stage("writing")
    train_idx, eval_idx = split(len(col.rows), params.eval_ratio, params.seed)
    train_path, eval_path = dataset_outputs(Path(ctx.datasets_dir), params.output_name)
    write_jsonl(train_path, col.rows, train_idx, ctx.job_id)
    write_jsonl(eval_path, col.rows, eval_idx, ctx.job_id)
    io.progress(1.0, message=f"wrote {len(train_idx)} train and {len(eval_idx)} eval rows")
    return {
        "train_path": str(train_path),
        "eval_path": str(eval_path),
        "format": fmt,
        "rows": {
            "read": col.read,
            "valid": len(col.rows) + col.duplicates,
            "bad": col.bad,
            "duplicates": col.duplicates,
            "kept": len(col.rows),
            "train": len(train_idx),
            "eval": len(eval_idx),
        },
        "bad_rows": col.bad_rows,
        "stats": stats(col.rows, tokens),
    }
