"""The ``dataset`` kind: any supported file -> canonical chat JSONL, split.

Reads JSONL, a JSON array, CSV/TSV, plain text, or Parquet (with pyarrow),
converts each row to ``{"messages": [...]}``, drops exact duplicates, splits
train/eval with a seeded shuffle and writes both files atomically into the
datasets dir. Bad rows never stop the job: they are counted, and the first
``max_bad_rows`` are reported with their line (or item) numbers.

Kept rows go to a spill file beside the outputs as they are read, and only
their offsets, sizes and a digest each stay in memory, so a file far larger
than RAM can be prepared (a JSON array is the exception: it is parsed whole).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jobs.context import JobContext, JobError, check_stop
from jobs.events import JobIO
from jobs.formats import RowError, detect_format, to_messages
from jobs.params import DatasetParams, JobParams, dataset_outputs
from jobs.tokenizer import open_tokenizer

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
    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield n, row


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


class _Spill:
    """Kept rows as output lines in a temp file, found again by offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("w+b")
        self._end = 0
        self.offsets = array("Q")

    def __len__(self) -> int:
        return len(self.offsets)

    def append(self, msgs: list[dict[str, str]]) -> None:
        line = json.dumps({"messages": msgs}, ensure_ascii=False).encode() + b"\n"
        self.offsets.append(self._end)
        self._file.write(line)
        self._end += len(line)

    def written(self) -> None:
        """All rows are in: make them readable by offset."""
        self._file.flush()

    def line(self, i: int) -> bytes:
        start = self.offsets[i]
        end = self.offsets[i + 1] if i + 1 < len(self.offsets) else self._end
        # pread: no seek, so the file's buffer is not thrown away each row.
        return os.pread(self._file.fileno(), end - start, start)

    def rows(self) -> Iterator[list[dict[str, str]]]:
        self._file.seek(0)
        for line in self._file:
            yield json.loads(line)["messages"]

    def close(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


class _Collector:
    def __init__(self, params: DatasetParams, where: str, spill: _Spill) -> None:
        self.params = params
        self.where = where
        self.rows = spill
        self.seen: set[bytes] = set()
        self.read = self.bad = self.duplicates = 0
        self.bad_rows: list[dict[str, Any]] = []
        # Per kept row, for the stats: message count and characters.
        self.roles: Counter[str] = Counter()
        self.messages = array("Q")
        self.chars = array("Q")

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
        self.roles.update(m["role"] for m in msgs)
        self.messages.append(len(msgs))
        self.chars.append(sum(len(m["content"]) for m in msgs))


def collect(io: JobIO, params: DatasetParams, path: Path, spill: _Spill) -> tuple[_Collector, str]:
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
    col = _Collector(params, where, spill)
    for i, (n, row) in enumerate(_chain(pending, rows)):
        if i % 1000 == 0:
            check_stop(io, f"after {i} rows")
        col.add(n, row, fmt)
    return col, fmt


def _chain(first: list[Raw], rest: Iterator[Raw]) -> Iterator[Raw]:
    yield from first
    yield from rest


# ------------------------------------------------------------------ stats


def _dist(values: array[int]) -> dict[str, float]:
    if not values:
        return {"min": 0, "max": 0, "mean": 0.0, "p50": 0, "p95": 0, "total": 0}
    s = np.sort(np.frombuffer(values, dtype=np.uint64))
    n = len(s)
    return {
        "min": int(s[0]),
        "max": int(s[-1]),
        "mean": round(float(s.mean()), 2),
        "p50": int(s[n // 2]),
        "p95": int(s[min(n - 1, int(n * 0.95))]),
        "total": int(s.sum()),
    }


def token_counts(io: JobIO, model_path: str, rows: _Spill) -> array[int]:
    """Tokens per row with the model's own tokenizer (message contents only,
    no BOS/EOS, special-token text counted as plain text)."""
    io.stage("tokenizing")
    counts = array("Q")
    progress = _Progress(io)
    # The system temp dir: the job's own dirs may be too long for a socket path.
    with open_tokenizer(model_path, Path(tempfile.gettempdir())) as tok:
        for i, msgs in enumerate(rows.rows()):
            counts.append(sum(tok.count(m["content"]) for m in msgs))
            if i % 1000 == 0:
                check_stop(io, f"after tokenizing {i} rows")
                progress(0.7 + 0.2 * i / max(1, len(rows)), f"tokenized {i} rows")
    return counts


def stats(col: _Collector, tokens: array[int] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "roles": dict(col.roles),
        "messages_per_row": _dist(col.messages),
        "chars": _dist(col.chars),
    }
    if tokens is not None:
        out["tokens"] = _dist(tokens)
    return out


# ------------------------------------------------------------------ output


def split(n: int, ratio: float, seed: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    order = np.random.default_rng(seed).permutation(n)
    n_eval = round(n * ratio)
    if ratio > 0 and n >= 2:
        n_eval = max(1, min(n_eval, n - 1))
    elif n < 2:
        n_eval = 0
    return order[n_eval:], order[:n_eval]


def write_jsonl(path: Path, rows: _Spill, order: np.ndarray[Any, Any], job_id: str) -> None:
    tmp = path.with_name(f".{path.name}.{job_id}.tmp")
    try:
        with tmp.open("wb") as f:
            for i in order:
                f.write(rows.line(int(i)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def run(io: JobIO, params: JobParams, ctx: JobContext) -> dict[str, Any]:
    if not isinstance(params, DatasetParams) or params.output_name is None:
        raise JobError("dataset needs resolved DatasetParams")
    path = Path(params.input)
    train_path, eval_path = dataset_outputs(Path(ctx.datasets_dir), params.output_name)
    spill = _Spill(train_path.with_name(f".{params.output_name}.{ctx.job_id}.rows.tmp"))
    try:
        return _prepare(io, params, ctx, path, spill, (train_path, eval_path))
    finally:
        spill.close()


def _prepare(io: JobIO, params: DatasetParams, ctx: JobContext, path: Path, spill: _Spill,
             outputs: tuple[Path, Path]) -> dict[str, Any]:
    io.stage("reading")
    col, fmt = collect(io, params, path, spill)
    spill.written()
    io.log(f"{col.read} rows read, {col.bad} bad, {col.duplicates} duplicates")
    if not len(spill):
        raise JobError(f"no usable rows in {path.name} ({col.bad} bad)")
    tokens = token_counts(io, params.model, spill) if params.model else None
    check_stop(io, "before writing")
    io.stage("writing")
    train_idx, eval_idx = split(len(spill), params.eval_ratio, params.seed)
    train_path, eval_path = outputs
    write_jsonl(train_path, spill, train_idx, ctx.job_id)
    write_jsonl(eval_path, spill, eval_idx, ctx.job_id)
    io.progress(1.0, message=f"wrote {len(train_idx)} train and {len(eval_idx)} eval rows")
    return {
        "train_path": str(train_path),
        "eval_path": str(eval_path),
        "format": fmt,
        "rows": {
            "read": col.read,
            "valid": len(spill) + col.duplicates,
            "bad": col.bad,
            "duplicates": col.duplicates,
            "kept": len(spill),
            "train": len(train_idx),
            "eval": len(eval_idx),
        },
        "bad_rows": col.bad_rows,
        "stats": stats(col, tokens),
    }
