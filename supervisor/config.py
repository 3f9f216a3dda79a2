"""Configuration: defaults < TOML file < GPUVISOR_* environment < CLI flags.

Everything is decoded into :class:`Config`; a bad value is a startup error
that names the key (``ConfigError``).
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from formats.chat_templates import TemplateFileError, read_template_file
from jobs.errors import validation_param
from supervisor.workers.connection import Endpoint

ENV_PREFIX = "GPUVISOR_"
# Variables of that prefix that are no setting: the token the CLI sends
# (``gpuvisor status``, ``pull``), which a shell may export for every command.
CLIENT_ENV = frozenset({"GPUVISOR_TOKEN"})


class ConfigError(Exception):
    pass


CacheType = Literal["f16", "q8_0", "q4_0"]
# off; draft: a smaller model of the same vocabulary drafts; mtp: the model's
# own next-token-prediction layers draft; ngram: prompt lookup; auto: draft
# when a draft model is set, else mtp when the model has MTP layers, else off.
SpeculativeMode = Literal["off", "draft", "mtp", "ngram", "auto"]
MAX_DRAFT = 64
AuthMode = Literal["auto", "on", "off"]
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: str | int | float) -> float:
    """Seconds from 300, "300", "5m", "1h30m" or "-1" (negative = forever)."""
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip().lower()
    try:
        return float(text)
    except ValueError:
        pass  # not a bare number: parse units below
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _DURATION.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"not a duration: {value!r} (use seconds or e.g. 30s, 5m, 1h)")
    return sign * sum(float(n) * _UNIT[u] for n, u in parts)


# Engine slots per worker: each holds a whole context of KV cache.
MAX_PARALLEL = 64
# With parallel automatic: the slots planned first, beside the context...
DEFAULT_PARALLEL_GPU = 4
DEFAULT_PARALLEL_CPU = 2
# ...and the most it grows to where memory allows (supervisor/models/slots.py).
AUTO_PARALLEL_MAX_GPU = 16
AUTO_PARALLEL_MAX_CPU = 8
# RoPE scaling past the native context: the most it multiplies it by.
MAX_ROPE_SCALE = 64.0
# none: a slot's context stops at the model's native (training) context;
# yarn: YaRN scaling reaches past it (supervisor/models/rope.py).
RopeScaling = Literal["none", "yarn"]

class ModelSettings(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """How to load one model; every field optional (unset = the global default)."""

    n_ctx: int | None = None
    cache_type: CacheType | None = None
    n_gpu_layers: int | None = None
    # The older spelling of speculative = "ngram" with draft_max = N (0 = off).
    draft_ngram: Annotated[int, msgspec.Meta(ge=0, le=MAX_DRAFT)] | None = None
    speculative: SpeculativeMode | None = None
    # A library id: the model that drafts with speculative = "draft" (or "auto").
    draft_model: str | None = None
    # Tokens drafted per step; unset = the engine's defaults.
    draft_min: Annotated[int, msgspec.Meta(ge=0, le=MAX_DRAFT)] | None = None
    draft_max: Annotated[int, msgspec.Meta(ge=1, le=MAX_DRAFT)] | None = None
    keep_alive: str | int | float | None = None
    # Generations a worker runs at once (engine slots); 0 = automatic: as
    # many as fit beside the context, from 2 (CPU) or 4 (GPU) up to 8 or 16.
    parallel: int | None = None
    # A Jinja chat template file to prompt with instead of the model's own
    # (or of the built-in one for its architecture). Checked at startup, and
    # at a load that sets it: at most 256 KiB of UTF-8 whose Jinja parses.
    chat_template_file: str | None = None
    # Thinking on or off for requests that do not say: the template variable
    # enable_thinking (chat_template_kwargs), as Qwen 3 style templates read it.
    enable_thinking: bool | None = None
    # Past the model's native context: "yarn" with n_ctx above it (or
    # rope_scale, the factor it multiplies the native context by);
    # yarn_orig_ctx: the context YaRN scales from (default: the header's
    # original context, else its native one).
    rope_scaling: RopeScaling | None = None
    rope_scale: Annotated[float, msgspec.Meta(gt=1.0, le=MAX_ROPE_SCALE)] | None = None
    yarn_orig_ctx: Annotated[int, msgspec.Meta(ge=16)] | None = None
    # Sampling for requests that leave the field out, over the model file's
    # own defaults (supervisor/generation/sampling.py); bounds as a request's.
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] | None = None

    def __post_init__(self) -> None:
        if self.n_ctx is not None and self.n_ctx < 16:
            raise ValueError("n_ctx must be at least 16")
        if self.parallel is not None and not 0 <= self.parallel <= MAX_PARALLEL:
            raise ValueError(f"parallel must be within 0..{MAX_PARALLEL}")
        if self.keep_alive is not None:
            parse_duration(self.keep_alive)

    def speculative_mode(self) -> SpeculativeMode:
        """The drafting asked for, with draft_ngram read as its older spelling."""
        if self.speculative is not None:
            return self.speculative
        return "ngram" if self.draft_ngram else "off"

    def draft_lengths(self) -> tuple[int, int]:
        """(min, max) tokens drafted per step; 0 = the engine's default."""
        most = self.draft_max or (self.draft_ngram or 0 if self.speculative_mode() == "ngram" else 0)
        return self.draft_min or 0, most

    def speculative_problem(self) -> tuple[str, str] | None:
        """(setting, why) when the speculative settings contradict each other."""
        mode = self.speculative_mode()
        if self.draft_ngram and mode != "ngram":
            return "draft_ngram", (f'draft_ngram means speculative = "ngram"; with speculative = "{mode}" '
                                   "set draft_max instead")
        if self.draft_ngram and self.draft_max and self.draft_ngram != self.draft_max:
            return "draft_ngram", "draft_ngram and draft_max disagree; set only draft_max"
        if self.draft_min and self.draft_max and self.draft_min > self.draft_max:
            return "draft_min", f"draft_min ({self.draft_min}) is above draft_max ({self.draft_max})"
        if mode == "draft" and not self.draft_model:
            return "draft_model", 'speculative = "draft" needs draft_model (a model id from the library)'
        return None

    def rope_problem(self) -> tuple[str, str] | None:
        """(setting, why) when a RoPE scaling value is set with no scaling
        named; rope_scaling = "none" turns scaling off, whatever else is set."""
        if self.rope_scaling is not None:
            return None
        for name in ("rope_scale", "yarn_orig_ctx"):
            if getattr(self, name) is not None:
                return name, f'{name} takes effect only with rope_scaling = "yarn"'
        return None

    def over(self, base: ModelSettings) -> ModelSettings:
        """These settings, with unset fields taken from ``base``."""
        merged = base._spelled_out()
        merged.update({k: v for k, v in self._spelled_out().items() if v is not None})
        return ModelSettings(**merged)

    def _spelled_out(self) -> dict[str, Any]:
        """The fields, with draft_ngram = N read as what it means in this
        layer: speculative = "ngram" and draft_max = N (0: "off"). Set beside
        speculative or another draft_max, it stays, for speculative_problem
        to refuse."""
        fields = msgspec.structs.asdict(self)
        clash = bool(self.draft_ngram and self.draft_max and self.draft_max != self.draft_ngram)
        if self.draft_ngram is not None and self.speculative is None and not clash:
            fields.update(speculative="ngram" if self.draft_ngram else "off", draft_ngram=None)
            if self.draft_ngram and self.draft_max is None:
                fields["draft_max"] = self.draft_ngram
        return fields


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8470
    state_dir: str = ""
    models_dir: str = ""
    config: str = ""
    log_level: str = "info"
    # HTTP
    max_body_bytes: int = 16 * 1024 * 1024
    # Seconds a JSON request body may take to arrive (a stalled client holds
    # a connection and its buffer until then).
    body_timeout: float = 60.0
    # Worker pool
    preload: list[str] = []
    queue_limit: int = 64
    # Context per request; 0 = automatic: the model's native context, capped
    # by memory (agent clients send prompts of 20,000 tokens and more).
    n_ctx: int = 0
    n_gpu_layers: int = -1
    n_threads: int = 0
    handshake_timeout: float = 600.0
    # Where the parent listens for its workers to dial back: "" (a Unix
    # socket in the run dir) or "tcp:HOST" (a free port on HOST per worker
    # start, for workers on other machines: docs/cluster.md).
    worker_listen: str = ""
    # A Ray cluster to run the workers on ("" = this machine only): the
    # parent joins it as a driver (docs/cluster.md); needs worker_listen = "tcp:HOST".
    ray_address: str = ""
    # How long requests in flight on a worker that ended with its node's agent
    # wait for the cluster to say whether the node is gone (node_lost) before
    # they end as a crash: about Ray's default health checks (docs/cluster.md).
    node_verdict_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 30.0
    ping_interval: float = 2.0
    ping_timeout: float = 10.0
    kill_grace: float = 5.0
    restart_backoff_min: float = 0.5
    restart_backoff_max: float = 30.0
    crash_limit: int = 5
    crash_window: float = 60.0
    shutdown_timeout: float = 15.0
    write_demo_model: bool = True
    # Model lifecycle
    max_loaded_models: int = 3
    keep_alive: str | int | float = "5m"
    cache_type: CacheType = "f16"
    draft_ngram: Annotated[int, msgspec.Meta(ge=0, le=MAX_DRAFT)] = 0  # prompt lookup for every model (0 = off)
    parallel: int = 0
    min_ctx: int = 2048
    # Memory gpuvisor may use for models (MiB); 0 = whatever is free.
    memory_budget_mib: int = 0
    # Share of each GPU's free memory a placement keeps back (0.1 = 10 %).
    gpu_headroom: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.1
    # Longest wait for the driver to show memory freed (an eviction, a job's end).
    gpu_settle_timeout: Annotated[float, msgspec.Meta(ge=0.0, le=600.0)] = 10.0
    load_wait_timeout: float = 30.0
    load_stall_timeout: float = 60.0
    model_defaults: dict[str, ModelSettings] = {}
    # Model library
    extra_model_dirs: list[str] = []
    # The Hugging Face Hub cache that is listed and that downloads fill;
    # unset: huggingface_hub's default (HF_HUB_CACHE, HF_HOME); "off": none
    # is listed (supervisor/models/hub_cache.py).
    hf_cache_dir: str = ""
    hf_token: str = ""
    library_settle_s: float = 0.5
    # The Python of the vLLM environment that serves Hugging Face (hf)
    # models; unset: <checkout>/.venv-vllm/bin/python where `make install-vllm`
    # made one (beside our package, or beside the running venv).
    vllm_python: str = ""
    # Runaway guard (per request; /api/models shows both under "limits").
    # Output tokens of a request that sets no limit of its own: enough for a
    # reasoning model's thinking plus a whole file written in one tool call,
    # and far less than a 32k-128k context a runaway would otherwise fill.
    default_max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 16384
    # Seconds a request may run once its worker took it (prefill included);
    # past it, it ends as if by its token limit. 0 = no limit.
    request_timeout_s: Annotated[float, msgspec.Meta(ge=0.0)] = 600.0
    # A caller (API key; the client address with auth off) in flight at this
    # many worker crashes within the window is refused (429 crash_cooldown)
    # until they age out, so one user's crashers cannot fail models for all.
    # 0 = off (a single-user machine, where every request comes from one caller).
    caller_crash_limit: Annotated[int, msgspec.Meta(ge=0)] = 3
    caller_crash_window_s: Annotated[float, msgspec.Meta(gt=0.0)] = 600.0
    # Seconds a request may wait in a model's queue for a slot (while the
    # worker serves; a load or a restart does not count); past it, 503 queue_timeout with
    # Retry-After. Two minutes: longer than a normal burst takes to drain,
    # short enough that a client learns the model is pinned and can retry or
    # go elsewhere, well inside SDK timeouts (OpenAI's: 600 s). 0 = no limit.
    queue_timeout_s: Annotated[float, msgspec.Meta(ge=0.0)] = 120.0
    # Responses API: stored responses are kept this long (0 = forever).
    responses_retention_days: float = 30.0
    responses_keepalive_s: float = 10.0
    # Hosted tools (supervisor/responses/hosted/): URL prefixes of the MCP
    # servers responses may call (empty: mcp tools are refused), and the
    # tool loop's limits (Studio's: 25 rounds, 300 s a call).
    mcp_allowed_urls: list[str] = []
    hosted_max_iterations: Annotated[int, msgspec.Meta(ge=1)] = 25
    hosted_call_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 300.0
    hosted_total_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 1800.0
    hosted_suppress_duplicates: bool = True
    # Files and vector stores (supervisor/knowledge/): the largest file
    # /v1/files takes (413 past it; 64 MiB holds a book as plain text many
    # times over, and an upload is read to disk, never into memory), and
    # the served model whose embeddings index files for file_search ("":
    # vector stores are refused with a 409 naming this setting).
    files_max_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 40)] = 64 << 20
    file_search_embedding_model: str = ""
    # The bytes of files one API key's vector stores may hold together (a
    # file once per store it is in; an add past it is a 413 naming this
    # setting; 0: no bound; the admin's stores are not bound), and the
    # seconds between sweeps that delete stores whose expires_after passed
    # (until then they are listed as expired and refuse searches).
    vector_stores_max_bytes_per_key: Annotated[int, msgspec.Meta(ge=0, le=1 << 50)] = 1 << 30
    vector_stores_sweep_interval_s: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)] = 300.0
    # Lab: jobs and the GPU lease
    datasets_dir: str = ""
    outputs_dir: str = ""
    devices: list[str] = []
    max_concurrent_jobs: int = 0
    job_grace_s: float = 30.0
    job_heartbeat_timeout: float = 120.0
    job_retention_days: float = 14.0
    drain_timeout: float = 30.0
    max_upload_bytes: int = 1 << 30
    # For tests only: offer the test-only job kinds (``sleep``) in the API.
    test_job_kinds: bool = False
    # Hosted tool code_interpreter (supervisor/sandbox/): off until enabled;
    # enabled, the service refuses to start the tool (with the reason) where
    # the sandbox cannot be made. Limits per run: CPU seconds, address space,
    # wall clock, the largest file, processes and threads, open files.
    code_interpreter: bool = False
    code_interpreter_cpu_s: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 30
    code_interpreter_memory_mib: Annotated[int, msgspec.Meta(ge=64, le=1 << 20)] = 1024
    code_interpreter_wall_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 60.0
    code_interpreter_file_mib: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 64
    code_interpreter_processes: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 32
    code_interpreter_open_files: Annotated[int, msgspec.Meta(ge=16, le=65536)] = 256
    # Containers: how many at once (a full pool removes the least recently
    # used one not running code; a key holding half the pool, one of its
    # own first), seconds idle before one (and its folder)
    # is removed, and where their folders live ("" = <state_dir>/containers).
    code_interpreter_max_containers: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 16
    code_interpreter_idle_s: Annotated[float, msgspec.Meta(gt=0.0)] = 1200.0
    code_interpreter_dir: str = ""
    # The Python that runs the code ("" = the service's own); a service
    # running as root runs it as this uid and gid (nobody by default).
    code_interpreter_python: str = ""
    code_interpreter_uid: Annotated[int, msgspec.Meta(ge=1)] = 65534
    code_interpreter_gid: Annotated[int, msgspec.Meta(ge=1)] = 65534
    # Hosted tool web_search (supervisor/responses/hosted/web_search.py): a
    # SearXNG search endpoint answering format=json ("": off; the address
    # rules of MCP servers apply), the results one search hands the model
    # at most, and the seconds one search may take.
    web_search_searxng_url: str = ""
    web_search_max_results: Annotated[int, msgspec.Meta(ge=1, le=50)] = 8
    web_search_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=300.0)] = 10.0
    # Running as a service: auth, proxies, logs (supervisor/auth.py, proxies.py, logs.py)
    admin_token: str = ""  # plain, or a scrypt$ hash from `gpuvisor keys admin-token`
    api_keys: list[str] = []  # "NAME:ID:scrypt$..." from `gpuvisor keys add NAME --print-config`
    allow_unauthenticated: bool = False  # permit a non-loopback bind with no auth at all
    allowed_origins: list[str] = []  # extra browser origins allowed to change state
    trusted_proxies: list[str] = []  # addresses/CIDRs whose X-Forwarded-* are believed
    log_format: str = "text"  # text, kv or json
    access_log: bool = True
    # "auto": authentication turns on with the first admin token or API key and
    # stays on: revoking the last database key refuses every protected route
    # (401) until a key is added, it never serves openly. "on": required even
    # before any key exists. "off": the explicit switch back to no
    # authentication (a non-loopback bind also needs allow_unauthenticated).
    auth: AuthMode = "auto"
    # Failed authentications a client address (IPv6: its /64) may make per
    # auth_failure_window seconds; then 429 with Retry-After, and no hashing.
    auth_failure_limit: int = 10
    auth_failure_window: float = 60.0
    # Host names requests may carry besides loopback names and the address we
    # listen on (DNS rebinding defence); "*.example.org" covers subdomains.
    trusted_hosts: list[str] = []
    # Connections (supervisor/proxies.py): seconds a client has to send a
    # request's headers (from the connection's start or its first byte);
    # seconds an idle keep-alive connection stays open (longer than a proxy's
    # own upstream keep-alive, nginx's is 60 s, so the proxy closes first);
    # open connections per client address (IPv6: per /64), the excess closed
    # at once. Trusted proxies are exempt from the per-client cap.
    header_timeout: float = 10.0
    keepalive_timeout: float = 75.0
    max_connections_per_client: int = 256

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be within 0..65535")
        if self.queue_limit < 0:
            raise ValueError("queue_limit must be >= 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.body_timeout <= 0:
            raise ValueError("body_timeout must be > 0")
        if self.header_timeout <= 0 or self.keepalive_timeout <= 0:
            raise ValueError("header_timeout and keepalive_timeout must be > 0")
        if self.max_connections_per_client < 1:
            raise ValueError("max_connections_per_client must be at least 1")
        if self.auth_failure_limit < 1 or self.auth_failure_window <= 0:
            raise ValueError("auth_failure_limit must be at least 1 and auth_failure_window > 0")
        if not 0 <= self.parallel <= MAX_PARALLEL:
            raise ValueError(f"parallel must be within 0..{MAX_PARALLEL}")
        if self.max_loaded_models < 1:
            raise ValueError("max_loaded_models must be at least 1")
        parse_duration(self.keep_alive)
        if Endpoint.parse(self.worker_listen).transport != "tcp" and self.ray_address:
            raise ValueError('ray_address needs worker_listen = "tcp:HOST": workers on other nodes dial back over TCP')
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError("log_level must be debug, info, warning or error")
        for model_id, own in self.model_defaults.items():
            problem = own.speculative_problem() or own.rope_problem()
            if problem is not None:
                raise ValueError(f"model_defaults.{model_id}.{problem[0]}: {problem[1]}")

    def model_settings(self, model_id: str) -> ModelSettings:
        """Global defaults overlaid with this model's own defaults."""
        base = ModelSettings(n_ctx=self.n_ctx or None, cache_type=self.cache_type, n_gpu_layers=self.n_gpu_layers,
                             draft_ngram=self.draft_ngram, keep_alive=self.keep_alive,
                             parallel=self.parallel)
        own = self.model_defaults.get(model_id)
        return base if own is None else own.over(base)

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)

    @property
    def models_path(self) -> Path:
        return Path(self.models_dir)

    @property
    def run_path(self) -> Path:
        return self.state_path / "run"

    @property
    def db_path(self) -> Path:
        return self.state_path / "gpuvisor.db"


_FIELDS = {f.name: f.type for f in msgspec.structs.fields(Config)}


def default_state_dir(environ: Mapping[str, str]) -> Path:
    # systemd's StateDirectory= sets STATE_DIRECTORY (possibly a ':' list).
    if environ.get("STATE_DIRECTORY"):
        return Path(environ["STATE_DIRECTORY"].split(":")[0])
    home = Path(environ.get("HOME", str(Path.home())))
    return home / ".local" / "share" / "gpuvisor"


def default_vllm_python() -> str:
    """The vLLM venv `make install-vllm` makes in a checkout, where one exists:
    beside our package (an editable install) or beside the running venv."""
    for base in (Path(__file__).resolve().parent.parent, Path(sys.prefix).parent):
        candidate = base / ".venv-vllm" / "bin" / "python"
        if candidate.is_file():
            return str(candidate)
    return ""


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key in CLIENT_ENV:
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in _FIELDS:
            raise ConfigError(f"unknown setting {key}")
        if _FIELDS[name] == list[str]:
            out[name] = [v for v in (p.strip() for p in value.split(",")) if v]
        else:
            out[name] = value
    return out


def load_config(
    cli: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Merge every source and validate; raises ConfigError naming the key."""
    environ = os.environ if environ is None else environ
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    env = _from_env(environ)
    state_dir = cli.get("state_dir") or env.get("state_dir") or str(default_state_dir(environ))
    explicit = cli.get("config") or env.get("config")
    config_path = Path(explicit) if explicit else Path(state_dir) / "config.toml"
    from_file: dict[str, Any] = {}
    if config_path.exists():
        try:
            from_file = tomllib.loads(config_path.read_text())
        except (tomllib.TOMLDecodeError, OSError) as exc:
            raise ConfigError(f"cannot read config file {config_path}: {exc}") from exc
    elif explicit:
        raise ConfigError(f"config file {config_path} does not exist")
    merged: dict[str, Any] = {**from_file, **env, **cli}
    merged["config"] = str(config_path)
    merged.setdefault("state_dir", state_dir)
    try:
        # strict=False: environment values arrive as strings ("8470", "true").
        cfg = msgspec.convert(merged, Config, strict=False)
    except msgspec.ValidationError as exc:
        key = validation_param(exc)
        where = f" {key}" if key else ""
        raise ConfigError(f"invalid setting{where}: {exc}") from exc
    if not cfg.vllm_python:
        cfg.vllm_python = default_vllm_python()
    cfg.model_defaults = _checked_template_files(cfg.model_defaults, config_path.parent)
    for name, sub in (("models_dir", "models"), ("datasets_dir", "datasets"), ("outputs_dir", "outputs")):
        if not getattr(cfg, name):
            setattr(cfg, name, str(Path(cfg.state_dir) / sub))
    return cfg


def _checked_template_files(defaults: dict[str, ModelSettings], base: Path) -> dict[str, ModelSettings]:
    """The model settings with each chat_template_file resolved (a relative
    one against the config file's folder) and checked: one that cannot be
    used is a startup error naming it, not a failed load later."""
    out = dict(defaults)
    for model_id, own in defaults.items():
        if not own.chat_template_file:
            continue
        path = base / Path(own.chat_template_file).expanduser()
        try:
            read_template_file(path)
        except TemplateFileError as exc:
            raise ConfigError(f"model_defaults.{model_id}.chat_template_file: {exc}") from exc
        out[model_id] = msgspec.structs.replace(own, chat_template_file=str(path.resolve()))
    return out
