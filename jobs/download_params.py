"""Parameters of a ``download`` job, validated by the parent at submit time.

Pure validation: nothing here touches the network or the disk.
"""

from __future__ import annotations

import re

import msgspec

from jobs.errors import FieldValueError
from jobs.params import NodeParams

# owner/name: the Hub's canonical ids without an owner ("gpt2") redirect to
# an owned repo; a bare word is far more often a typo than one of those.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_QUANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]{0,31}$")
_REVISION = re.compile(r"^[\w./-]{1,200}$")


class DownloadParams(NodeParams):
    """What to fetch from the Hub into its cache.

    Exactly one way to choose files: ``patterns`` (fnmatch globs over the
    repo's paths), ``quant`` (a GGUF quantization name such as ``Q4_K_M``:
    the matching file or complete shard set), or neither when the repo holds
    a single GGUF model. ``fallback_smaller`` picks, when the choice does not
    fit on disk, the largest smaller GGUF variant of the repo that does.
    ``mmproj`` also fetches the repo's vision projector, if it has one.
    ``node`` runs it on that cluster node, into that node's own Hub cache.
    """

    repo_id: str
    revision: str = "main"
    patterns: list[str] = msgspec.field(default_factory=list)
    quant: str | None = None
    fallback_smaller: bool = False
    mmproj: bool = True

    def __post_init__(self) -> None:
        if not _REPO_ID.fullmatch(self.repo_id) or ".." in self.repo_id:
            raise FieldValueError(f"repo_id {self.repo_id!r} is not a Hub repository: expected owner/name, "
                                  "e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF", field="repo_id")
        # huggingface_hub joins the revision into a cache path (refs/<revision>):
        # a leading "/" would make that path absolute.
        if not _REVISION.fullmatch(self.revision) or ".." in self.revision or self.revision.startswith("/"):
            raise FieldValueError(f"invalid revision {self.revision!r}", field="revision")
        if self.quant is not None and not _QUANT.fullmatch(self.quant):
            raise FieldValueError(f"invalid quant {self.quant!r} (expected a name such as Q4_K_M)", field="quant")
        if self.quant is not None and self.patterns:
            raise FieldValueError("give either patterns or quant, not both", field="patterns")
        for pattern in self.patterns:
            if not pattern or pattern.startswith("/") or ".." in pattern.split("/"):
                raise FieldValueError(f"invalid pattern {pattern!r}", field="patterns")


def parse_download_params(params: dict[str, object]) -> DownloadParams:
    """Validate raw job params; raises ``msgspec.ValidationError`` naming the field."""
    return msgspec.convert(params, DownloadParams)


def parse_pull_spec(spec: str) -> DownloadParams:
    """``REPO[:QUANT]`` or ``REPO@REVISION[:QUANT]`` as typed on the command line;
    raises :class:`FieldValueError` naming the part that is wrong."""
    repo, _, quant = spec.partition(":")
    repo, _, revision = repo.partition("@")
    return DownloadParams(repo_id=repo, revision=revision or "main", quant=quant or None)
