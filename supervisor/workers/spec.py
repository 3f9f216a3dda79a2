"""What a worker runs (``WorkerSpec``) and the timings that supervise it (``Timing``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from worker.protocol import RopeOptions, SpeculativeOptions


@dataclass(frozen=True)
class WorkerSpec:
    model_id: str
    path: Path
    embedding: bool
    n_ctx: int
    n_gpu_layers: int
    n_threads: int
    device: str = "cpu"
    cache_type: str = "f16"
    # Speculative decoding as the worker runs it (mode, draft model path, lengths).
    speculative: SpeculativeOptions = SpeculativeOptions()
    # Requests the worker runs at once (its engine slots).
    parallel: int = 1
    # The vision projector (mmproj) to load with the model, if the library links one.
    mmproj: Path | None = None
    # GGUF LoRA adapters the worker holds, applied per request, and each
    # one's (size, mtime) as the library saw it then: a file changed since is
    # not what the worker holds.
    lora: tuple[Path, ...] = ()
    lora_versions: tuple[tuple[int, float], ...] = ()
    # The lease devices the worker is placed on (all of them are booked), and
    # the GPU indices it is pinned to (CUDA/HIP/ROCR_VISIBLE_DEVICES); None:
    # not pinned (no GPU in the lease). A split gives each GPU its share.
    devices: tuple[str, ...] = ()
    gpu_indices: tuple[int, ...] | None = None
    tensor_split: tuple[float, ...] = ()
    # The engine (worker/engine_api.py ENGINES) and the Python that runs the
    # worker: "" = the parent's own (vLLM workers run from their own venv).
    engine: str = "llamacpp"
    python: str = ""
    # The bytes of every file of the model (all shards of a split GGUF, an
    # hf model's weights): what load progress is measured against. 0: the
    # size of ``path`` alone.
    model_bytes: int = 0
    # A chat template file the worker prompts with instead of the model's own.
    chat_template_file: Path | None = None
    # YaRN scaling past the native context (none unless a load asked for it).
    rope: RopeOptions = RopeOptions()
    # What the load asked for beyond context and layers (launch_spec.load_ask):
    # a load asking the same again reuses this worker.
    asked: tuple[object, ...] = ()


@dataclass(frozen=True)
class Timing:
    handshake_timeout: float
    ping_interval: float
    ping_timeout: float
    kill_grace: float
    backoff_min: float
    backoff_max: float
    crash_limit: int
    crash_window: float
    heartbeat: float = 1.0
    # A load that shows no progress (worker memory not growing) for this long fails.
    load_stall_timeout: float = 60.0
    # How long requests on a worker gone with its node's agent wait for the
    # cluster's verdict on that node (config node_verdict_s).
    node_verdict_s: float = 30.0
