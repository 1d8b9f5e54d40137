"""Configuration: one frozen dataclass per concern, validated once at start-up.

Each field's ``help`` metadata is its documentation and the CLI help text.
``from_dict`` rejects unknown keys so a typo in a config file fails loudly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is unknown or out of range."""


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


@dataclass(frozen=True)
class QueuePolicy:
    """How one priority level's queue admits and expires requests (Triton's ModelQueuePolicy)."""

    max_queue_size: int = _help(
        "Most inputs that may wait at this priority level; beyond it a request is "
        "refused at once with 503 and Retry-After. One request may hold at most half "
        "of it (a larger one is refused with 413), so no single request fills the queue.",
        default=4096,
    )
    default_timeout_s: float = _help(
        "Seconds a request may wait in the queue; a request still queued at its deadline "
        "is answered 504 and never runs.",
        default=30.0,
    )
    allow_timeout_override: bool = _help(
        "Whether a request may ask for a shorter queue timeout than the default.",
        default=True,
    )

    def __post_init__(self) -> None:
        _require(self.max_queue_size >= 1, "max_queue_size must be >= 1")
        _require(self.default_timeout_s > 0, "default_timeout_s must be > 0")


@dataclass(frozen=True)
class BatchingConfig:
    """Dynamic batching knobs for one model (after Triton's dynamic batcher)."""

    max_batch_size: int = _help("Most requests in one executed batch.", default=128)
    max_queue_delay_ms: float = _help(
        "Most milliseconds the oldest waiting request is held back to let a batch grow; "
        "0 runs whatever is waiting as soon as the device is free.",
        default=0.0,
    )
    preferred_batch_sizes: tuple[int, ...] = _help(
        "Batch sizes that are sent as soon as they can be formed, without waiting out "
        "the queue delay.",
        default=(),
    )
    max_batch_tokens: int = _help(
        "Token budget of one batch: the sum of input lengths for a ragged model, the "
        "batch size times the longest input for a padded one.",
        default=16384,
    )
    priority_levels: int = _help("Number of priority levels; level 1 runs first.", default=1)
    default_priority_level: int = _help("Priority level of a request that names none.", default=1)
    queue_policy: QueuePolicy = _help(  # noqa: RUF009 (field() with metadata, not a call default)
        "Queue policy of every priority level.", default_factory=QueuePolicy
    )
    priority_queue_policy: Mapping[int, QueuePolicy] = _help(
        "Queue policy overrides per priority level.", default_factory=dict
    )

    def __post_init__(self) -> None:
        _require(self.max_batch_size >= 1, "max_batch_size must be >= 1")
        _require(self.max_queue_delay_ms >= 0, "max_queue_delay_ms must be >= 0")
        _require(self.max_batch_tokens >= 1, "max_batch_tokens must be >= 1")
        _require(self.priority_levels >= 1, "priority_levels must be >= 1")
        _require(
            1 <= self.default_priority_level <= self.priority_levels,
            "default_priority_level must be between 1 and priority_levels",
        )
        for size in self.preferred_batch_sizes:
            _require(
                1 <= size <= self.max_batch_size,
                f"preferred batch size {size} must be between 1 and max_batch_size",
            )
        for level in self.priority_queue_policy:
            _require(
                1 <= level <= self.priority_levels,
                f"priority_queue_policy names level {level}, outside 1..priority_levels",
            )
        object.__setattr__(
            self, "preferred_batch_sizes", tuple(sorted(set(self.preferred_batch_sizes)))
        )

    def policy_for(self, level: int) -> QueuePolicy:
        """The queue policy of ``level``."""
        return self.priority_queue_policy.get(level, self.queue_policy)


@dataclass(frozen=True)
class RuntimeConfig:
    """The device runtime."""

    device: str = _help("Torch device the runtime owns: cpu or cuda[:N].", default="cpu")
    threads: int = _help(
        "Intra-op threads for torch on the CPU; 0 keeps torch's default.", default=0
    )

    cache_dir: str = _help(
        "Folder for converted model files (a GGUF file is converted once); empty: "
        "$XDG_CACHE_HOME/carpool or ~/.cache/carpool.",
        default="",
    )
    switch_interval_ms: float = _help(
        "Python's GIL switch interval in milliseconds: how long the event loop may keep "
        "the runtime thread waiting between two model ops.",
        default=0.5,
    )
    engine_process: bool | None = _help(
        "Run each generation model's engine (scheduler, model, detokenizer) in a process "
        "of its own, as vLLM's engine core: the HTTP event loop then has this process's "
        "GIL to itself. Such a model no longer takes turns with the others on the device "
        "runtime. Unset: on for a GPU, off on the CPU.",
        # On an H200, 64 streams over HTTP went from 0.50-0.53 of the offline rate to
        # 0.82-0.94 (BENCHMARKS.md).
        default=None,
    )

    def resolved(self) -> RuntimeConfig:
        """This config with ``engine_process`` resolved for ``device``."""
        if self.engine_process is not None:
            return self
        return dataclasses.replace(self, engine_process=self.device != "cpu")

    def __post_init__(self) -> None:
        _require(self.switch_interval_ms > 0, "switch_interval_ms must be > 0")
        _require(
            self.device == "cpu" or self.device.startswith("cuda"),
            f"device must be cpu or cuda[:N], got {self.device!r}",
        )
        _require(self.threads >= 0, "threads must be >= 0")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` (vLLM's name; JSON), e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4}`` or ``{"method": "draft_model", "model": "<name or
    path>"}``."""

    method: str = _help(
        "Drafting method: ngram (prompt lookup, no extra model) or draft_model (a small "
        "model's greedy tokens; it must share the target's vocabulary).",
        default="ngram",
    )
    model: str = _help(
        "The draft model for draft_model: a built-in name, a folder or a .gguf file.",
        default="",
    )
    draft_kv_cache_memory: str = _help(
        "The draft model's own KV cache (draft_model), e.g. 64MiB.", default="64MiB"
    )
    num_speculative_tokens: int = _help("Most tokens drafted per step.", default=4)
    prompt_lookup_max: int = _help("Longest n-gram looked up.", default=4)
    prompt_lookup_min: int = _help("Shortest n-gram looked up.", default=2)
    disable_by_batch_size: int = _help(
        "No drafts in a step with more running sequences than this.", default=4
    )
    min_acceptance: float = _help(
        "A sequence whose recent drafts are accepted less than this (0 to 1) pauses "
        "drafting for a while.",
        default=0.3,
    )

    def __post_init__(self) -> None:
        _require(
            self.method in ("ngram", "draft_model"),
            f"method must be ngram or draft_model, got {self.method!r}",
        )
        _require(
            bool(self.model) == (self.method == "draft_model"),
            "model names the draft model: required for draft_model, not used by ngram",
        )
        parse_size(self.draft_kv_cache_memory)
        # kernels/prefill_attention.h ROWWISE_CHUNK (17) follows this bound
        _require(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens in [1, 16]")
        _require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16,
            "need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16",
        )
        _require(self.disable_by_batch_size >= 1, "disable_by_batch_size must be >= 1")
        _require(0.0 <= self.min_acceptance <= 1.0, "min_acceptance must be in [0, 1]")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON text; raises ``ConfigError``."""
        return from_json(cls, text, "speculative_config")


WEIGHT_KERNELS = ("auto", "native", "native-int8", "torch")
_SIZE_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from ``512MiB``, ``2GiB`` or a plain number of bytes."""
    stripped = text.strip().upper()
    number = stripped.rstrip("KMGIB")
    unit = stripped[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value <= 0:
        raise ConfigError(f"not a size: {text!r} (use e.g. 512MiB or 2GiB)")
    return int(value * _SIZE_UNITS[unit])


@dataclass(frozen=True)
class EngineConfig:
    """The generation engine: KV cache, scheduling and admission (vLLM's names)."""

    kv_cache_memory: str = _help(
        "Memory for the paged KV cache of each generation model, e.g. 512MiB or 2GiB; "
        "the number of blocks is derived from it. auto: 1GiB on the CPU; on a GPU what "
        "gpu_memory_utilization leaves once the model is loaded.",
        default="auto",
    )
    gpu_memory_utilization: float = _help(
        "On a GPU with kv_cache_memory auto: the fraction of the device's memory this "
        "process may use in all (weights, activations, CUDA graphs and KV cache), as vLLM's "
        "option of the same name.",
        default=0.9,
    )
    num_scheduler_steps: int = _help(
        "On a GPU: forward passes per decode step for greedy requests without penalties, "
        "grammars or log-probabilities, each feeding the last's token back on the device, "
        "so the host schedules and syncs once per this many tokens (vLLM's multi-step "
        "scheduling; tokens then stream in bursts). 1: off. The CPU ignores it.",
        default=1,
    )
    cuda_graphs: bool = _help(
        "On a GPU: replay decode steps from CUDA graphs captured at start-up, one per "
        "batch-size bucket up to max_num_seqs (off: every step runs eagerly).",
        default=True,
    )
    cuda_graph_prompts: bool = _help(
        "On a GPU with cuda_graphs: steps that run prompt chunks (prefill, or prompts "
        "beside decodes) replay graphs too, one per token-count bucket up to "
        "max_num_batched_tokens, instead of launching every kernel from Python. Not for a "
        "model with sliding-window layers in a pool of their own.",
        default=False,
    )
    async_scheduling: bool | None = _help(
        "Plan and launch each engine step before the last one's tokens are back, so the "
        "host's work (scheduling, detokenizing, stop strings) overlaps the device's (vLLM's "
        "option of the same name); a request with penalties, a grammar, log-probabilities "
        "or prompt log-probabilities runs in steps that wait. Not with speculative_config "
        "or num_scheduler_steps > 1. Unset: on a GPU unless one of those is asked for, off "
        "on the CPU, where a step runs inside its launch and nothing overlaps.",
        # On an H200 it gave the same tokens and 9-44% more tokens/s (BENCHMARKS.md).
        default=None,
    )
    block_size: int = _help("Tokens per KV-cache block.", default=16)
    max_num_batched_tokens: int = _help(
        "Token budget of one engine step (decodes plus prompt chunks); a longer prompt is "
        "prefilled in chunks of at most this size. Smaller: shorter steps for the running "
        "streams while prompts prefill; larger: more throughput. 0: 192 on the CPU, 2048 "
        "on a GPU.",
        # 64 streams here, prompt chunks on the fused stack: inter-token p99 0.37-0.38 s
        # at 192 against 0.40-0.47 s at 256 (two runs each) and 0.55 s at 384; the
        # throughput difference (221-239 vs 227-248 tok/s) was within run-to-run noise
        # (BENCHMARKS.md).
        # On an H100, 64 streams over HTTP: 4,759 tok/s with 2048 against 3,068 with 192,
        # TTFT p50 0.39 vs 0.86 s, ITL p99 27 vs 33 ms (BENCHMARKS.md).
        default=0,
    )
    max_num_seqs: int = _help("Most sequences running in one engine step.", default=128)
    max_model_len: int = _help(
        "Longest prompt plus generation, in tokens; 0 uses the model's context length. "
        "Never more than the KV cache holds (where every layer has a sliding window, "
        "than its window and a step need).",
        default=0,
    )
    enable_prefix_caching: bool = _help(
        "Share full KV blocks between requests with the same prefix.", default=True
    )
    max_waiting_requests: int = _help(
        "Most requests waiting to start; beyond it a request is refused at once with 503 "
        "and Retry-After.",
        default=256,
    )
    request_timeout_s: float = _help(
        "Seconds a request may wait to start; one that has not started by then is "
        "answered 503 with Retry-After. A request may ask for a shorter timeout.",
        default=60.0,
    )
    dtype: str = _help(
        "Weights and KV cache dtype: float32, bfloat16, float16, or auto (float32 on the "
        "CPU, bfloat16 on a GPU).",
        default="auto",
    )
    kv_cache_dtype: str = _help(
        "The KV cache's dtype: auto (the model's, as dtype resolves it), float32, "
        "float16 or bfloat16 (vLLM's option of the same name; its fp8 kinds are not "
        "offered). On the CPU float16 holds twice the tokens in kv_cache_memory and "
        "halves the bytes attention reads a step, keys and values rounded to half "
        "precision as in llama.cpp's default cache; the native kernels read float32 and "
        "float16. On a GPU: the model's dtype only.",
        default="auto",
    )
    attention_kernel: str = _help(
        "Attention over the paged cache: native (C, compiled at start-up with the "
        "machine's compiler; reads the cache in place; CPU, a float32 model, a float32 or "
        "float16 cache; decode rows, and prompt rows too inside the fused stack), torch, or "
        "auto (native where it can run, else torch).",
        default="auto",
    )
    weight_kernel: str = _help(
        "Linear layers of a GGUF model with quantized matrices (Q4_0, Q4_1, Q5_0, Q5_1, "
        "Q8_0, Q4_K, Q5_K, Q6_K): native (C kernels over the file's blocks, the same float32 "
        "weights; with native attention a step's whole "
        "decoder stack runs in one C call), native-int8 (native, but rows round their "
        "activations to int8 per block of 32 and use integer dot products, as llama.cpp "
        "does: every step's rows with AVX2 or AVX-512 VNNI, each matrix (and each part "
        "of a fused one) in its file's bits, "
        "else steps of up to 8 rows; faster, not "
        "exact; its perplexity is in BENCHMARKS.md), "
        "torch (float32 GEMM only), or auto (native where it can run; native-int8 for a "
        "K-quant file such as Q4_K_M, as llama.cpp runs it, where the CPU has AVX2).",
        default="auto",
    )

    speculative_config: str = _help(
        "Speculative decoding, as JSON (vLLM's --speculative-config), e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\': prompt lookup drafts '
        "tokens from the request's own text and one step verifies them; also "
        "prompt_lookup_min/max, disable_by_batch_size, min_acceptance. Or "
        '\'{"method": "draft_model", "model": "<name, folder or .gguf>"}\': a small '
        "model with the same vocabulary drafts (its own KV cache: draft_kv_cache_memory, "
        "64MiB). Empty: off.",
        default="",
    )

    def __post_init__(self) -> None:
        if self.kv_cache_memory != "auto":
            parse_size(self.kv_cache_memory)
        _require(
            0 < self.gpu_memory_utilization <= 1,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(
            self.weight_kernel in WEIGHT_KERNELS,
            f"weight_kernel must be one of {', '.join(WEIGHT_KERNELS)}, got {self.weight_kernel!r}",
        )
        _require(
            self.attention_kernel in ("auto", "native", "torch"),
            f"attention_kernel must be auto, native or torch, got {self.attention_kernel!r}",
        )
        _require(self.block_size in (8, 16, 32, 64, 128), "block_size must be 8, 16, 32, 64 or 128")
        _require(self.max_num_batched_tokens >= 0, "max_num_batched_tokens must be >= 0")
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(1 <= self.num_scheduler_steps <= 64, "num_scheduler_steps must be in 1..64")
        _require(self.max_model_len >= 0, "max_model_len must be >= 0")
        _require(self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1")
        _require(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}",
        )
        _require(
            self.kv_cache_dtype in ("auto", "float32", "bfloat16", "float16"),
            "kv_cache_dtype must be auto, float32, bfloat16 or float16, got "
            f"{self.kv_cache_dtype!r}",
        )
        drafts = bool(self.speculative_config) or self.num_scheduler_steps > 1
        _require(
            not (self.async_scheduling and drafts),
            "async_scheduling does not combine with speculative_config or num_scheduler_steps > 1",
        )
        if self.speculative_config:
            SpeculativeConfig.parse(self.speculative_config)

    @property
    def kv_cache_bytes(self) -> int | None:
        """The KV cache's size; None for auto (the device decides)."""
        return None if self.kv_cache_memory == "auto" else parse_size(self.kv_cache_memory)

    def model_len(self, context: int, kv_tokens: int) -> int:
        """``max_model_len`` resolved for a model of ``context`` positions whose KV
        cache holds ``kv_tokens``: 0 takes the context, and never more than the
        cache holds (as vLLM: a longer sequence could never run)."""
        return min(self.max_model_len or context, kv_tokens)

    def for_device(self, device: str) -> EngineConfig:
        """This config with what depends on the device (cpu or cuda) resolved: the
        step budget (0), asynchronous scheduling (unset) and the dtype (auto). The one
        place those defaults are decided; resolving twice changes nothing."""
        drafts = bool(self.speculative_config) or self.num_scheduler_steps > 1
        cpu = device == "cpu"
        return dataclasses.replace(
            self,
            max_num_batched_tokens=self.max_num_batched_tokens or (192 if cpu else 2048),
            async_scheduling=(
                self.async_scheduling
                if self.async_scheduling is not None
                else not cpu and not drafts
            ),
            dtype=self.dtype if self.dtype != "auto" else ("float32" if cpu else "bfloat16"),
        )


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server."""

    host: str = _help("Address to bind.", default="127.0.0.1")
    port: int = _help("Port to bind; 0 picks a free one.", default=8000)
    grpc_port: int = _help(
        "Port of the KServe v2 gRPC service (Triton's GRPCInferenceService, as "
        "tritonclient.grpc speaks it), on --host; 0: no gRPC service; -1: a free port "
        "(the ready line says which). Not served with --replicas.",
        default=8001,
    )
    metrics_port: int = _help(
        "Also serve GET /metrics (only) on this port, as Triton's metrics port (8002 "
        "there); 0: /metrics on --port only; -1: a free port (the ready line says which).",
        default=0,
    )
    models: tuple[str, ...] = _help(
        "Models to serve: built-in names (see `carpool models`), local folders or files.",
        default=("smollm2-135m-instruct", "all-minilm-l6-v2"),
    )
    log_level: str = _help("Log level: debug, info, warning or error.", default="info")
    max_body_bytes: int = _help(
        "Largest request body accepted; a larger one is refused with 413 (the default is TGI's).",
        # Parsing a body holds the event loop ~0.1 s per million JSON values (token
        # ids): the default keeps that under ~0.1 s.
        default=2 * 1024 * 1024,
    )

    api_key: str = _help(
        "Require 'Authorization: Bearer <key>' on every model endpoint (health and "
        "metrics stay open); empty: no key. The CLI also reads CARPOOL_API_KEY.",
        default="",
    )
    shutdown_timeout_s: float = _help(
        "On SIGTERM, seconds to let requests in flight finish before exiting.",
        default=30.0,
    )
    served_model_name: tuple[str, ...] = _help(
        "Names to serve the --model entries under, in their order; a model past the "
        "list keeps its own name. With one model, as vLLM's --served-model-name: it "
        "is served under the first name and answers to the others too.",
        default=(),
    )
    tokenizer: str = _help(
        "The generation models' tokenizer from this folder or hub id instead of their "
        "own; empty: their own.",
        default="",
    )
    chat_template: str = _help(
        "The generation models' chat template: a file's path, or the template itself "
        "(Jinja); empty: the tokenizer's own.",
        default="",
    )
    generation_config: str = _help(
        "Sampling defaults for fields a request leaves unset (vLLM's "
        "--generation-config): auto, the model's generation_config.json; vllm, none "
        "(the API's own defaults); or a folder holding a generation_config.json.",
        default="auto",
    )
    reasoning_parser: str = _help(
        "Split a chat reply's <think>...</think> into message.reasoning_content "
        "(streamed as its own deltas): qwen3 or deepseek_r1 (vLLM's names); empty: off. "
        "Replies under a grammar (tools, response_format) are not split.",
        default="",
    )

    def __post_init__(self) -> None:
        _require(self.shutdown_timeout_s >= 0, "shutdown_timeout_s must be >= 0")
        _require(
            len(self.models) == 1 or len(self.served_model_name) <= len(self.models),
            f"served_model_name gives {len(self.served_model_name)} names for "
            f"{len(self.models)} models",
        )
        _require(
            len(set(self.served_model_name)) == len(self.served_model_name)
            and all(self.served_model_name),
            "served_model_name must be distinct, non-empty names",
        )
        _require(
            self.reasoning_parser in ("", "qwen3", "deepseek_r1"),
            f"reasoning_parser must be qwen3 or deepseek_r1, got {self.reasoning_parser!r}",
        )
        _require(0 <= self.port <= 65535, "port must be between 0 and 65535")
        _require(-1 <= self.grpc_port <= 65535, "grpc_port must be between -1 and 65535")
        _require(-1 <= self.metrics_port <= 65535, "metrics_port must be between -1 and 65535")
        _require(
            self.log_level in ("debug", "info", "warning", "error"),
            f"log_level must be debug, info, warning or error, got {self.log_level!r}",
        )
        _require(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")


@dataclass(frozen=True)
class ReplicasConfig:
    """Replicas on Ray Serve (``pip install carpool[ray]``): the same HTTP API on the
    same port from several whole carpools, routed by prompt prefix and load."""

    replicas: int = _help(
        "Serve from this many carpool replicas on Ray Serve, each on its share of the "
        "cores (or its own GPU); without the flag, one process and no Ray.",
        default=0,
    )
    ray_address: str = _help(
        "Join this Ray cluster (e.g. 10.0.0.5:6379 or auto) instead of starting a local "
        "one on 127.0.0.1.",
        default="",
    )
    ray_object_store_memory: str = _help(
        "Object store of a local Ray cluster; carpool passes only small messages "
        "through it, so it stays small (Ray's least is 75 MiB).",
        default="96MiB",
    )
    route_policy: str = _help(
        "How the ingress picks a replica: prefix (the replica holding the prompt's "
        "prefix, within route_max_imbalance) or power_of_two (Ray Serve's default: the "
        "less busy of two at random).",
        default="prefix",
    )
    route_max_imbalance: int = _help(
        "Prefix-affinity routing: a request goes to the replica that holds its prompt's "
        "prefix unless that replica has more than this many requests in flight above "
        "the least busy one; then the least busy takes it.",
        default=16,
    )
    health_check_period_s: float = _help(
        "Seconds between Ray Serve's health checks of a replica; a replica whose device "
        "runtime died is replaced at the next one.",
        default=2.0,
    )

    def __post_init__(self) -> None:
        _require(self.replicas >= 0, "replicas must be >= 1")
        _require(
            parse_size(self.ray_object_store_memory) >= 75 << 20,
            "ray_object_store_memory must be at least 75MiB",
        )
        _require(self.route_max_imbalance >= 0, "route_max_imbalance must be >= 0")
        _require(
            self.route_policy in ("prefix", "power_of_two"),
            f"route_policy must be prefix or power_of_two, got {self.route_policy!r}",
        )
        _require(self.health_check_period_s > 0, "health_check_period_s must be > 0")

    @property
    def object_store_bytes(self) -> int:
        return parse_size(self.ray_object_store_memory)


MODEL_CONTROL_MODES = ("none", "explicit", "poll")


@dataclass(frozen=True)
class RepositoryConfig:
    """User models from a model repository (Triton's layout or carpool.toml)."""

    model_repository: str = _help(
        "Folder of user models, one sub-folder each: Triton's layout (config.pbtxt and "
        "<version>/model.py) or carpool's (carpool.toml). Without --model, only these "
        "models are served.",
        default="",
    )
    model_control_mode: str = _help(
        "Triton's model control: none (load every repository model at start; no "
        "load/unload), explicit (load the --load-model ones at start; load and unload "
        "through /v2/repository) or poll (load every model; follow the folder's changes "
        "every --repository-poll-secs).",
        default="none",
    )
    load_model: tuple[str, ...] = _help(
        "Explicit mode: repository models to load at start ('*' for all).", default=()
    )
    repository_poll_secs: float = _help(
        "Poll mode: seconds between scans of the repository.", default=15.0
    )
    model_isolation: str = _help(
        "Where user model instances run: process (a worker process each, as Triton's "
        "Python stub: a crash, os._exit or hang fails only the batch in flight and the "
        "worker is restarted) or thread (in the server's process: faster to call, but a "
        "crash there ends the server), for the user's own code (Python-backend models, "
        "classes). A model's own isolation wins; library models (pipelines, "
        "sentence-transformers) and decoupled models run in a thread unless they ask.",
        default="process",
    )
    disable_auto_complete_config: bool = _help(
        "Do not call a Python-backend model's auto_complete_config: its config.pbtxt "
        "must then be complete (Triton's flag of the same name).",
        default=False,
    )
    model_execution_timeout_s: float = _help(
        "Seconds one batch of a user model may run; past it the batch fails and its "
        "instance is replaced (a worker process killed and restarted; an in-process "
        "instance's thread left behind and the model loaded anew); the model is unready "
        "while no instance is healthy. 0: no limit. A model's own execution_timeout_s wins.",
        default=60.0,
    )

    def __post_init__(self) -> None:
        _require(
            self.model_control_mode in MODEL_CONTROL_MODES,
            f"model_control_mode must be one of {', '.join(MODEL_CONTROL_MODES)}",
        )
        _require(
            self.model_isolation in ("thread", "process"),
            "model_isolation must be thread or process",
        )
        _require(self.repository_poll_secs > 0, "repository_poll_secs must be > 0")
        _require(self.model_execution_timeout_s >= 0, "model_execution_timeout_s must be >= 0")
        _require(
            not self.load_model or self.model_control_mode == "explicit",
            "load_model needs model_control_mode explicit",
        )


@dataclass(frozen=True)
class CarpoolConfig:
    """Everything `carpool serve` needs."""

    server: ServerConfig = field(default_factory=ServerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    replicas: ReplicasConfig = field(default_factory=ReplicasConfig)
    repository: RepositoryConfig = field(default_factory=RepositoryConfig)
    model_batching: Mapping[str, BatchingConfig] = field(default_factory=dict)

    def resolved(self) -> CarpoolConfig:
        """This config with every device-dependent default decided for
        ``runtime.device`` (``EngineConfig.for_device``, ``RuntimeConfig.resolved``):
        what ``build_server`` hands on, so nothing downstream resolves again."""
        return dataclasses.replace(
            self,
            runtime=self.runtime.resolved(),
            engine=self.engine.for_device(self.runtime.device),
        )

    def batching_for(self, model: str) -> BatchingConfig:
        """The batching config of ``model``: its own section, else the shared one."""
        return self.model_batching.get(model, self.batching)


def default_cache_dir() -> Path:
    """Where converted model files go: ``$XDG_CACHE_HOME/carpool``, else
    ``~/.cache/carpool``. The one place carpool reads this from the environment."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "carpool"


def default_compiler() -> str | None:
    """The C compiler that builds the kernels: ``$CC`` (a program name or path), else
    ``cc`` or ``gcc`` on PATH; None if there is none. The one place carpool reads
    this from the environment."""
    wanted = os.environ.get("CC", "").strip()
    if wanted:
        return shutil.which(wanted)
    return shutil.which("cc") or shutil.which("gcc")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def from_json(cls: type[T], text: str, name: str) -> T:
    """Build ``cls`` from a flag's JSON text (``from_dict``'s checks); ``name`` is
    the flag's, for the error."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} is not JSON: {exc}") from None
    return from_dict(cls, data)


def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
    """Build the dataclass ``cls`` from ``data``, rejecting unknown keys."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{cls.__name__} expects a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} key(s): {', '.join(unknown)}; "
            f"known: {', '.join(sorted(names))}"
        )
    kwargs = {
        key: _convert(hints[key], value, f"{cls.__name__}.{key}") for key, value in data.items()
    }
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value)  # type: ignore[arg-type]
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} expects a list, got {value!r}")
        return tuple(_convert(args[0], v, where) for v in value)
    if origin in (Mapping, dict) or origin is typing.get_origin(Mapping[str, int]):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} expects a mapping, got {value!r}")
        key_type, value_type = args
        return {
            _convert(key_type, k, where): _convert(value_type, v, f"{where}[{k}]")
            for k, v in value.items()
        }
    if origin in (types.UnionType, typing.Union):
        members = [a for a in args if a is not type(None)]
        if value is None or len(members) != 1:
            return value  # other unions: the dataclass's own checks
        return _convert(members[0], value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, str) and value.isdigit():
        return int(value)
    if hint in (int, float, str, bool) and not (
        isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{where} expects {hint.__name__}, got {value!r}")
    return value


def load_model_batching(path: Path) -> dict[str, BatchingConfig]:
    """Read a per-model config file: ``{"models": {name: {batching keys...}}}``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read model config {path}: {exc}") from exc
    if not isinstance(data, dict) or set(data) - {"models"}:
        raise ConfigError(f"{path}: expected an object with one key, 'models'")
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise ConfigError(f"{path}: 'models' must be an object")
    return {name: from_dict(BatchingConfig, section) for name, section in models.items()}


def field_help(cls: type[Any]) -> dict[str, str]:
    """Each field's help text, for the CLI."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}
