"""Job parameters, validated in the parent at submit time: the shared base
(:class:`JobParams`, path resolution, device choice) and the structs of the
kinds without a module of their own. The registry of kinds is
:mod:`jobs.kinds`.

This module is imported by the parent, so it (and every params struct) must
never import llama_cpp or torch.

Paths in params are resolved here, in the parent: every path must resolve
(symlinks followed) inside one of the configured roots, else 400. The stored
params carry the resolved absolute paths, so the job process trusts them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from jobs.errors import ParamError

ModelLookup = Callable[[str], Path | None]
# An output name is one plain file name: no directories, no hidden files.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

DatasetFormat = Literal["auto", "alpaca", "sharegpt", "messages", "text"]
QuantType = Literal[
    "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_0", "Q3_K_M"
]


@dataclass(frozen=True)
class Roots:
    """The directories request paths may point into."""

    models: Path
    datasets: Path
    outputs: Path

    def all(self) -> tuple[Path, ...]:
        return (self.models, self.datasets, self.outputs)


@dataclass(frozen=True)
class ResolveContext:
    roots: Roots
    # Maps a model id (as listed by /v1/models) to its GGUF file, if known.
    model_lookup: ModelLookup | None = None
    # Accept the test-only kinds (the test_job_kinds setting).
    test_kinds: bool = False


def resolve_path(value: str, default_root: Path, roots: Roots, param: str) -> Path:
    """A bare name or relative path is taken under ``default_root``; the
    result must lie inside one of the roots after resolving symlinks."""
    if not value or "\x00" in value:
        raise ParamError(f"{param} must be a non-empty path", param=param)
    raw = Path(value).expanduser()
    path = (raw if raw.is_absolute() else default_root / raw).resolve()
    if not any(path.is_relative_to(r.resolve()) for r in roots.all()):
        raise ParamError(
            f"{param} must be inside the models, datasets or outputs directory", param=param
        )
    return path


def existing_file(value: str, default_root: Path, roots: Roots, param: str) -> Path:
    path = resolve_path(value, default_root, roots, param)
    if not path.is_file():
        raise ParamError(f"{param}: no such file {value!r}", param=param, code="file_not_found")
    return path


def check_name(value: str, param: str) -> str:
    if not _NAME.match(value):
        raise ParamError(
            f"{param} must be a plain file name (letters, digits, '.', '_', '-')", param=param
        )
    return value


def resolve_model(value: str, ctx: ResolveContext, param: str) -> Path:
    """A model id known to the library, else a GGUF path inside the roots."""
    if ctx.model_lookup is not None:
        found = ctx.model_lookup(value)
        if found is not None:
            return found
    if "/" not in value and not value.endswith(".gguf"):
        candidate = ctx.roots.models / f"{value}.gguf"
        if candidate.is_file():
            return candidate.resolve()
    return existing_file(value, ctx.roots.models, ctx.roots, param)


class JobParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every kind's params."""

    def resolve(self, ctx: ResolveContext) -> None:
        """Replace user paths by resolved ones; raise ParamError naming the field."""

    def devices(self, available: Sequence[str]) -> list[str]:
        """The lease devices this job holds while it runs (none by default)."""
        return []

    def on_node(self) -> str | None:
        """The cluster node the job names to run on (:class:`NodeParams`); None: none named."""
        return None


class DeviceChoice(msgspec.Struct, kw_only=True):
    """Fields of a kind that holds devices: a count, or named ones."""

    # How many devices the job holds; the least used are taken.
    gpus: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # Exactly these devices ("cuda:1", "1", "cpu", or a cluster node's "node-b/cuda:0"); overrides ``gpus``.
    gpu_ids: Annotated[list[str], msgspec.Meta(min_length=1, max_length=64)] | None = None

    def pick(self, available: Sequence[str]) -> list[str]:
        """The devices to hold from ``available`` (best first); ParamError when
        the machine has too few or the named ones are not there."""
        if self.gpu_ids is not None:
            # A cluster node's device is named whole: "node-b/cuda:0".
            named = [i if i == "cpu" or i.startswith("cuda:") or "/" in i else f"cuda:{i}"
                     for i in self.gpu_ids]
            unknown = [n for n in named if n not in available]
            if unknown:
                raise ParamError(f"gpu_ids: no device {', '.join(unknown)} here; "
                                 f"known: {', '.join(sorted(available))}", param="params.gpu_ids")
            return list(dict.fromkeys(named))
        if self.gpus > len(available):
            raise ParamError(f"gpus: {self.gpus} asked, this machine has {len(available)}",
                             param="params.gpus")
        return list(available[: self.gpus])


# A cluster node's name as device ids carry it (``node-b`` in ``node-b/cuda:0``).
NodeName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]


class NodeParams(JobParams, kw_only=True):
    """Base of the kinds that book no device: ``node``, the cluster node to run on.

    None runs it on the parent's machine. The parent checks at submit time
    that a cluster is configured and has this node alive (the job runner,
    supervisor/lab/runner.py); the job process itself ignores it.
    """

    node: NodeName | None = None

    def on_node(self) -> str | None:
        return self.node


class DatasetParams(NodeParams):
    input: str
    format: DatasetFormat = "auto"
    eval_ratio: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.1
    seed: int = 0
    output_name: str | None = None
    dedupe: bool = True
    # A model (id or GGUF path) whose tokenizer counts tokens in the stats.
    model: str | None = None
    max_bad_rows: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 50
    overwrite: bool = False

    def resolve(self, ctx: ResolveContext) -> None:
        path = existing_file(self.input, ctx.roots.datasets, ctx.roots, "params.input")
        self.input = str(path)
        stem = path.name.split(".")[0] or "dataset"
        self.output_name = check_name(self.output_name or f"{stem}-chat", "params.output_name")
        if self.model is not None:
            self.model = str(resolve_model(self.model, ctx, "params.model"))
        outputs = dataset_outputs(ctx.roots.datasets, self.output_name)
        if path in outputs:
            raise ParamError("output_name would overwrite the input", param="params.output_name")
        if not self.overwrite and any(p.exists() for p in outputs):
            raise ParamError(
                f"outputs for {self.output_name!r} already exist; set overwrite to replace them",
                param="params.output_name",
                code="output_exists",
            )


def dataset_outputs(datasets_dir: Path, output_name: str) -> tuple[Path, Path]:
    return (datasets_dir / f"{output_name}.train.jsonl", datasets_dir / f"{output_name}.eval.jsonl")


class QuantizeParams(NodeParams):
    """Quantize a GGUF into the models dir. It runs ggml's CPU kernels, so it
    books no GPU (:meth:`JobParams.devices`): chat keeps serving meanwhile."""

    model: str
    type: QuantType
    output_name: str | None = None
    allow_requantize: bool = False
    overwrite: bool = False
    nthread: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0

    def resolve(self, ctx: ResolveContext) -> None:
        path = resolve_model(self.model, ctx, "params.model")
        self.model = str(path)
        stem = path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.stem
        name = self.output_name or f"{stem}-{self.type}"
        name = name if name.endswith(".gguf") else f"{name}.gguf"
        self.output_name = check_name(name, "params.output_name")
        out = ctx.roots.models / self.output_name
        if out.resolve() == path:
            raise ParamError("output_name would overwrite the input", param="params.output_name")
        if out.exists() and not self.overwrite:
            raise ParamError(
                f"{self.output_name} already exists; set overwrite to replace it",
                param="params.output_name",
                code="output_exists",
            )


class SleepParams(JobParams, DeviceChoice):
    """A cheap job for tests and benchmarks: N steps with progress. With
    ``node`` and ``use_device`` off it runs on that node like a kind that
    books no device."""

    steps: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 5
    step_seconds: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 0.05
    events_per_step: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 1
    # Misbehave on purpose at ``crash_at_step``: exit(3), SIGKILL itself, or SIGSTOP itself.
    crash: Literal["none", "exit", "kill", "stop"] = "none"
    crash_at_step: Annotated[int, msgspec.Meta(ge=0)] = 0
    ignore_term: bool = False
    use_device: bool = True
    tag: Annotated[str, msgspec.Meta(max_length=200)] = ""
    # Lines written to its log (stderr) at each step.
    log_lines: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    # As NodeParams' (msgspec structs take fields from one base only).
    node: NodeName | None = None

    def devices(self, available: Sequence[str]) -> list[str]:
        return self.pick(available) if self.use_device else []

    def on_node(self) -> str | None:
        return self.node
