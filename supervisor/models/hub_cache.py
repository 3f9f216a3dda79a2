"""Which Hugging Face Hub cache the service lists and the download job fills.

A pulled model is served because both use one directory, resolved once in
the parent from the ``hf_cache_dir`` setting:

- unset (the default): huggingface_hub's own default, read from the
  parent's environment (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else
  ``XDG_CACHE_HOME``/huggingface/hub, else ~/.cache/huggingface/hub);
- a path: that directory;
- ``off``: the library lists no Hub cache (a pull still downloads into the
  default one, and ``gpuvisor pull`` then says the model is not listed).

Jobs get the resolved directory as ``HF_HUB_CACHE``
(:func:`job_env`) instead of resolving it again from their own environment:
theirs is an allowlist (supervisor/lab/job_process.py) that drops, for
example, the older ``HUGGINGFACE_HUB_CACHE``, so a second resolution could
disagree with the first. A directory that does not exist yet is harmless:
the library's watcher picks it up when the first download creates it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

OFF = "off"


@dataclass(frozen=True)
class HubCache:
    # Where downloads go (HF_HUB_CACHE of every job).
    path: Path
    # Whether the library lists the GGUF models in it.
    listed: bool

    @property
    def scan_dir(self) -> Path | None:
        """The directory the library scans, or None when the scan is off."""
        return self.path if self.listed else None


def default_hub_cache() -> Path:
    """huggingface_hub's default cache for this process's environment (its
    constants are read once, at import: the parent's environment, which
    does not change while it runs). Absolute, as a job runs elsewhere."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).absolute()


def resolve(setting: str) -> HubCache:
    """The Hub cache that ``hf_cache_dir = setting`` means (see the module doc)."""
    text = setting.strip()
    if text.lower() == OFF:
        return HubCache(default_hub_cache(), listed=False)
    if text:
        # Absolute: a job runs in its own working directory.
        return HubCache(Path(text).expanduser().absolute(), listed=True)
    return HubCache(default_hub_cache(), listed=True)


def job_env(cache: HubCache) -> dict[str, str]:
    """What a job's environment needs so its downloads land where the library looks."""
    return {"HF_HUB_CACHE": str(cache.path)}
