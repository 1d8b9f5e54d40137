"""``engine_for``: an engine over a loaded model, with the runner its device needs (the
CPU's ``ModelRunner`` or the GPU's ``CudaModelRunner``), its KV cache sized, and a
draft model's engine where speculation asks for one. The one place that picks a
runner: no runner builds another."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from carpool.clock import Clock
from carpool.config import EngineConfig, SpeculativeConfig
from carpool.engine.draft_model import DraftModelProposer
from carpool.engine.engine import Engine
from carpool.models import registry
from carpool.models.causal_lm import LoadedLM
from carpool.models.decode_kernel import select_decode_kernel
from carpool.models.registry import LoadOptions
from carpool.paths import PathTaken
from carpool.workers.model_runner import ModelRunner

log = logging.getLogger(__name__)


def engine_for(
    lm: LoadedLM,
    config: EngineConfig | None = None,
    clock: Clock | None = None,
    num_blocks: int | None = None,
    cache_dir: Path | None = None,
) -> Engine:
    """An engine driving ``lm``: its KV cache sized by ``config.kv_cache_memory``
    (or ``num_blocks``), decode attention as ``config.attention_kernel`` asks. A
    ``draft_model`` speculative config loads its draft model (GGUF conversions under
    ``cache_dir``) onto an engine of its own; raises ValueError if its vocabulary is
    not the target's."""
    config = (config or EngineConfig()).for_device(lm.device.type)
    bs = config.block_size
    kv_dtype = kv_cache_dtype(lm, config)
    memory = _kv_cache_bytes(lm, config)
    blocks = num_blocks or ModelRunner.blocks_for_memory(lm, memory, bs, kv_dtype)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory {config.kv_cache_memory} holds no block")
    full, windowed = _pools(lm, config, memory, num_blocks, kv_dtype)
    blocks = full or blocks
    log.info(
        "%s: a KV cache of %d blocks of %d tokens (%d tokens), %s%s",
        lm.name,
        blocks,
        bs,
        blocks * bs,
        str(kv_dtype).removeprefix("torch."),
        f", and {windowed} blocks for its windowed layers" if windowed else "",
    )
    runner: ModelRunner
    if lm.device.type == "cuda":
        runner = _cuda_runner(lm, config, blocks, windowed)
    else:
        kernel, attention = select_decode_kernel(
            config.attention_kernel, lm.device, lm.dtype, kv_dtype
        )
        # The fused stack needs native attention.
        paths = (*(_without_stack(p) if kernel is None else p for p in lm.paths), attention)
        runner = ModelRunner(lm, blocks, bs, kernel, paths, windowed, kv_dtype)
    return Engine(runner, config, clock, _draft_proposer(lm, config, cache_dir))


def kv_cache_dtype(lm: LoadedLM, config: EngineConfig) -> torch.dtype:
    """``config.kv_cache_dtype`` for ``lm``: auto is the model's dtype. Raises
    ValueError for another dtype on a GPU, whose kernels read the model's."""
    if config.kv_cache_dtype == "auto":
        return lm.dtype
    dtype = getattr(torch, config.kv_cache_dtype)
    if lm.device.type == "cuda" and dtype != lm.dtype:
        model = str(lm.dtype).removeprefix("torch.")
        raise ValueError(
            f"kv_cache_dtype {config.kv_cache_dtype}: on a GPU the KV cache holds the "
            f"model's dtype ({model}); use auto"
        )
    return dtype


def _pools(
    lm: LoadedLM,
    config: EngineConfig,
    memory: int,
    num_blocks: int | None,
    kv_dtype: torch.dtype,
) -> tuple[int, int]:
    """A hybrid model's two pools (full, windowed), or (0, 0): one pool. ``num_blocks``
    given, each pool has that many. ``config``'s step budget is resolved."""
    if lm.config.hybrid_window() is None:
        return 0, 0
    if num_blocks:
        return num_blocks, num_blocks
    pools = ModelRunner.pools_for_memory(
        lm, memory, config.block_size, config.max_num_seqs, config.max_num_batched_tokens, kv_dtype
    )
    if min(pools) < 2:
        raise ValueError(
            f"kv_cache_memory {config.kv_cache_memory} holds no pair of pools for "
            f"{lm.name}'s windowed and full layers"
        )
    return pools


# The KV cache's size on the CPU when kv_cache_memory is auto.
CPU_KV_CACHE_BYTES = 1 << 30
# On a GPU, kept free of the KV cache beyond what is in use after loading: a step's
# activations (max_num_batched_tokens rows) and the CUDA graphs' pool.
GPU_HEADROOM_BYTES = 2 << 30


def _kv_cache_bytes(lm: LoadedLM, config: EngineConfig) -> int:
    """``kv_cache_memory``, or for auto: 1 GiB on the CPU; on a GPU, vLLM's meaning of
    ``gpu_memory_utilization`` (this process's share of the device, less what it
    holds now and the headroom)."""
    explicit = config.kv_cache_bytes
    if explicit is not None:
        return explicit
    if lm.device.type != "cuda":
        return CPU_KV_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(lm.device)
    # Everything in use now, this process's or another's, counts against the share;
    # the KV cache takes what is left of it, less the headroom.
    room = free - int(total * (1 - config.gpu_memory_utilization)) - GPU_HEADROOM_BYTES
    if room <= 0:
        held = torch.cuda.memory_reserved(lm.device)
        used_by_others = total - free - held
        raise ValueError(
            f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no room for a KV "
            f"cache on {lm.device} ({held / 2**30:.2f} GiB held here, "
            f"{used_by_others / 2**30:.2f} GiB by others, {total / 2**30:.1f} GiB in all)"
        )
    return room


def _cuda_runner(
    lm: LoadedLM, config: EngineConfig, blocks: int, window_blocks: int
) -> ModelRunner:
    """The GPU's runner: Triton paged attention, decode steps from CUDA graphs."""
    if config.attention_kernel == "native":
        raise ValueError("attention_kernel native runs on the CPU; on a GPU attention is Triton's")
    from carpool.workers.cuda_runner import CudaModelRunner

    paths = (
        *lm.paths,
        PathTaken(
            "attention",
            True,
            "Triton paged attention"
            + (", decode steps from CUDA graphs" if config.cuda_graphs else "")
            + (", prompt steps too" if config.cuda_graphs and config.cuda_graph_prompts else ""),
        ),
    )
    return CudaModelRunner(
        lm,
        blocks,
        config.block_size,
        paths,
        config.max_num_seqs,
        config.model_len(lm.config.max_context, blocks * config.block_size),
        config.cuda_graphs,
        config.num_scheduler_steps,
        window_blocks,
        config.cuda_graphs and config.cuda_graph_prompts,
        config.max_num_batched_tokens,
    )


def _draft_proposer(
    lm: LoadedLM, config: EngineConfig, cache_dir: Path | None
) -> DraftModelProposer | None:
    if not config.speculative_config:
        return None
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec.method != "draft_model":
        return None
    # A draft only proposes (the target verifies), so it takes whatever kernels it can
    # run: a draft without GGUF blocks is no error under the target's "native".
    kernels = "torch" if config.weight_kernel == "torch" else "auto"
    options = LoadOptions(
        device=str(lm.device),
        dtype=str(lm.dtype).removeprefix("torch."),
        cache_dir=cache_dir,
        weight_kernel=kernels,
    )
    source = registry.resolve(spec.model)
    if source.task is not registry.Task.GENERATE:
        raise ValueError(f"the draft model {spec.model!r} is not a text generation model")
    draft = registry.load(source, options)
    if draft.config.vocab_size != lm.config.vocab_size:
        raise ValueError(
            f"the draft model {spec.model!r} has {draft.config.vocab_size} tokens in its "
            f"vocabulary and the target {lm.config.vocab_size}: they must be the same"
        )
    draft_config = dataclasses.replace(
        config,
        kv_cache_memory=spec.draft_kv_cache_memory,
        enable_prefix_caching=True,
        speculative_config="",
        weight_kernel=kernels,
        async_scheduling=False,  # the proposer steps it and reads each step's tokens
    )
    return DraftModelProposer(engine_for(draft, draft_config))


def _without_stack(path: PathTaken) -> PathTaken:
    if path.part == "decoder stack" and path.native:
        return PathTaken(path.part, False, "decode attention is not native")
    return path
