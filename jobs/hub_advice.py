"""A download that cannot reach the Hub at all: which failures those are (told
by their types, never by their text) and what to do instead, in the words the
job page and ``gpuvisor pull`` show (the job's error is that advice; its log
keeps the raw error).
"""

from __future__ import annotations


def hub_unreachable(exc: BaseException) -> bool:
    """``exc``, or an error it was raised from, says the Hub could not be
    reached: no name, no route, refused, timed out, a proxy in the way, or
    huggingface_hub's offline mode (its ``LocalEntryNotFoundError`` is raised
    from the connection error, so the chain is walked)."""
    import httpx2
    from huggingface_hub.errors import OfflineModeIsEnabled

    kinds = (httpx2.ConnectError, httpx2.TimeoutException, httpx2.ProxyError, ConnectionError,
             OfflineModeIsEnabled)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kinds):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def hub_unreachable_help(endpoint: str, models_dir: str, cache_dir: str) -> list[str]:
    """What to do when the service cannot reach the Hub at ``endpoint``."""
    return [
        f"gpuvisor could not reach the Hugging Face Hub at {endpoint}. Instead:",
        f"  - copy a .gguf file into the models directory ({models_dir}); it is listed within seconds",
        "  - set HF_ENDPOINT in the service's environment to a Hub mirror it can reach, and pull again",
        (f"  - use a Hugging Face cache: the GGUF models in the service's ({cache_dir}, or another one set as "
         "hf_cache_dir) are listed, and HF_HUB_OFFLINE=1 in the service's environment makes a pull use only it"),
    ]
