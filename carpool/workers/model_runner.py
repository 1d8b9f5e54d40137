"""Runs one scheduled step as one forward pass over all its tokens, then samples.

Owns the KV cache tensors; the block manager owns which blocks are whose. The
step's tokens are laid out single-token rows first (batched attention), then the
multi-token prompt chunks (see ``carpool.models.attention``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import cast

import torch

from carpool.engine.block_manager import slot_of
from carpool.engine.outputs import ScheduledChunk, SchedulerOutput
from carpool.engine.runner import (
    EngineModelSpec,
    Launch,
    PromptLogprobs,
    Sampled,
    SamplingRow,
    StepResult,
    TokenLogprobs,
)
from carpool.engine.sampling_params import Grammar
from carpool.engine.sequence import Sequence
from carpool.engine.structured import GrammarConstraint, Grammars
from carpool.models.attention import (
    AttentionMetadata,
    NativeDecode,
    PrefillSegment,
    SingleGroup,
    allocate_kv_cache,
    kv_bytes_per_block,
)
from carpool.models.causal_lm import LoadedLM
from carpool.models.decode_kernel import DecodeKernel
from carpool.paths import PathTaken
from carpool.workers.sampler import choose, make_generator, sample, verify
from carpool.workers.step_tensors import (
    Chosen,
    StepInputs,
    check_ids,
    chunk_ids,
    pending_tokens,
    resolve_pending,
)

BlocksOf = Callable[[Sequence], list[int]]  # a sequence's blocks in one pool
HEAD_BYTES = 2 << 20  # about the most bytes of logits a CPU step holds at once (_head_rows)
HEAD_TILE = 8  # the interleaved kernels' rows a tile (interleaved.h's TILE_ROWS)


def head_parts(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """Split items of ``sizes`` rows each into consecutive parts ``(first, end)`` of
    at most ``limit`` rows; an item with more rows than that is a part of its own."""
    parts: list[tuple[int, int]] = []
    first, rows = 0, 0
    for i, size in enumerate(sizes):
        if i > first and rows + size > limit:
            parts.append((first, i))
            first, rows = i, 0
        rows += size
    if first < len(sizes):
        parts.append((first, len(sizes)))
    return parts


def _sampling_rows(hidden: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """The rows of ``hidden`` that produce logits. Where there are as many as rows, they
    are every row in order (``prepare`` takes each sampling chunk's last rows, so only
    a step of decodes and drafts samples every row): ``hidden`` itself, no gather (on
    the CPU the gather right after the weights' stream took ~0.10 ms of a 1.2B token,
    this check ~0.04)."""
    if len(sample_index) == len(hidden):
        return hidden
    return hidden[sample_index]


def _full_blocks(seq: Sequence) -> list[int]:
    return seq.block_table.blocks


def windowed_blocks(seq: Sequence) -> list[int]:
    """The sequence's blocks in a hybrid model's windowed pool."""
    table = seq.block_table.windowed
    if table is None:
        raise ValueError(f"{seq.request_id} has no blocks in the windowed pool")
    return table.blocks


# Single-token rows attended per call, after sorting by context length: small groups
# pad less, large ones make fewer calls (16 measured better than 8, 32 or 64 here).
SINGLE_GROUP = 16


class ModelRunner:
    """The engine's ``Runner`` on a torch model."""

    def __init__(
        self,
        lm: LoadedLM,
        num_blocks: int,
        block_size: int,
        decode_kernel: DecodeKernel | None = None,
        paths: tuple[PathTaken, ...] = (),
        window_blocks: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``decode_kernel``: attends the single-token rows; None: torch, in groups.
        ``paths``: which code runs each part of a step, as said to users.
        ``window_blocks``: for a hybrid model (``DecoderConfig.hybrid_window``), the
        blocks of its windowed layers' own pool (``pools_for_memory``), which the
        engine frees behind the window; 0: every layer keeps ``num_blocks``.
        ``kv_dtype``: the KV cache's (None: the model's)."""
        cfg = lm.config
        self.lm = lm
        windows = set(cfg.layer_windows())
        hybrid = cfg.hybrid_window() if window_blocks else None
        if window_blocks and hybrid is None:
            raise ValueError(f"{lm.name} has no windowed layers beside full ones to pool")
        self.spec = EngineModelSpec(
            lm.name,
            cfg.vocab_size,
            cfg.max_context,
            lm.eos_token_ids,
            lm.tokenizer,
            sliding_window=windows.pop() if len(windows) == 1 else None,
            hybrid_window=hybrid,
            window_blocks=window_blocks,
        )
        self.num_blocks = num_blocks
        self.paths = paths
        self.multi_step = False  # the GPU's runner may (``CudaModelRunner``)
        self.device_type = lm.device.type
        self.grammars = Grammars(lm.tokenizer, cfg.vocab_size, sorted(lm.eos_token_ids))
        self.block_size = block_size
        self.decode_kernel = decode_kernel
        self.device = lm.device
        layer_blocks = [
            window_blocks if hybrid is not None and w is not None else num_blocks
            for w in cfg.layer_windows()
        ]
        self.caches = allocate_kv_cache(
            layer_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_dtype or lm.dtype,
            lm.device,
        )

    def make_generator(self, seed: int) -> torch.Generator:
        return make_generator(seed, self.device)

    def compile_grammar(self, grammar: Grammar, param: str) -> None:
        self.grammars.compile(grammar, param)

    def make_constraint(self, grammar: Grammar) -> GrammarConstraint:
        return self.grammars.constraint(grammar)

    @staticmethod
    def blocks_for_memory(
        lm: LoadedLM, memory_bytes: int, block_size: int, kv_dtype: torch.dtype | None = None
    ) -> int:
        """The blocks ``memory_bytes`` holds where every layer shares one pool, of
        ``kv_dtype`` (None: the model's dtype)."""
        per_block = ModelRunner._layer_block_bytes(lm, block_size, lm.config.num_layers, kv_dtype)
        return memory_bytes // per_block

    @staticmethod
    def pools_for_memory(
        lm: LoadedLM,
        memory_bytes: int,
        block_size: int,
        max_num_seqs: int,
        step_tokens: int,
        kv_dtype: torch.dtype | None = None,
    ) -> tuple[int, int]:
        """A hybrid model's two pools in ``memory_bytes``: (full, windowed) blocks. The
        windowed pool gets what ``max_num_seqs`` sequences' windows hold at once, a
        partial block at each end of each, a step of ``step_tokens`` and the null
        block, but never more than one pool for every layer would give it; the
        layers that attend everything get the rest. (0, 0) for a model that is not
        hybrid."""
        cfg = lm.config
        window = cfg.hybrid_window()
        if window is None:
            return 0, 0
        windowed_layers = sum(w is not None for w in cfg.layer_windows())
        full_layers = cfg.num_layers - windowed_layers
        per_layer = ModelRunner._layer_block_bytes(lm, block_size, 1, kv_dtype)
        shared = memory_bytes // (per_layer * cfg.num_layers)
        per_window = -(-window // block_size) + 2
        wanted = max_num_seqs * per_window + -(-step_tokens // block_size) + 1
        windowed = min(shared, wanted)
        full = (memory_bytes - windowed * per_layer * windowed_layers) // (per_layer * full_layers)
        return full, windowed

    @staticmethod
    def _layer_block_bytes(
        lm: LoadedLM, block_size: int, layers: int, kv_dtype: torch.dtype | None
    ) -> int:
        cfg = lm.config
        dtype = kv_dtype or lm.dtype
        return kv_bytes_per_block(layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)

    @torch.inference_mode()
    def execute(
        self,
        step: SchedulerOutput,
        rows: Mapping[str, SamplingRow],
        prompt_logprobs: Mapping[str, int] | None = None,
    ) -> StepResult:
        """Run ``step``; sample one token for each chunk that reaches its sequence's
        end. ``rows`` maps a sampling chunk's sequence id to its sampling row;
        ``prompt_logprobs`` maps the sequences that want prompt log-probabilities to
        how many top alternatives each.

        Re-running a chunk writes the same K/V to the same slots, so a failed step
        may be retried chunk by chunk."""
        inputs = self.prepare(step)
        self._begin()
        hidden = self.lm.model(inputs.input_ids, inputs.positions, self.caches, inputs.meta)
        result = StepResult()
        if prompt_logprobs:
            result.prompt_logprobs = self._prompt_logprobs(
                step, inputs.chunk_starts, hidden, prompt_logprobs
            )
        chunks = inputs.sampling_chunks
        picked = _sampling_rows(hidden, inputs.sample_index)
        for first, end, part in self._head_parts(chunks):
            logits = self.lm.model.compute_logits(picked[first:end])
            result.sampled.update(self._sample(logits, part, rows))
        return result

    @torch.inference_mode()
    def launch(
        self, step: SchedulerOutput, rows: Mapping[str, SamplingRow], after: Launch | None
    ) -> Launch:
        """``LaunchingRunner.launch``: the forward pass and the choice of each sampling
        chunk's token are queued (on the CPU they have run when this returns)."""
        tokens, chunks = self._launch_tokens(step, rows, after)
        order = {c.seq.request_id: j for j, c in enumerate(chunks)}
        return Launch(order, self._hand_off(tokens))

    def land(self, launch: Launch) -> StepResult:
        """``LaunchingRunner.land``: the launched step's tokens, by sequence."""
        tokens = self._wait(cast(Chosen, launch.handle))
        return StepResult({rid: Sampled(tokens[j], None) for rid, j in launch.rows.items()})

    def _launch_tokens(
        self, step: SchedulerOutput, rows: Mapping[str, SamplingRow], after: Launch | None
    ) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """The token chosen for each of the step's sampling chunks (on the device,
        not waited for), and the chunks in that order."""
        inputs = self.prepare(step, after)
        self._begin()
        pending = pending_tokens(after)
        if pending is not None:
            resolve_pending(inputs.input_ids, pending)
        hidden = self.lm.model(inputs.input_ids, inputs.positions, self.caches, inputs.meta)
        chunks = inputs.sampling_chunks
        picked = _sampling_rows(hidden, inputs.sample_index)
        tokens = [
            choose(
                self.lm.model.compute_logits(picked[first:end]),
                [rows[c.seq.request_id] for c in part],
            )
            for first, end, part in self._head_parts(chunks)
        ]
        if not tokens:
            return torch.empty(0, dtype=torch.long, device=self.device), chunks
        return (tokens[0] if len(tokens) == 1 else torch.cat(tokens)), chunks

    def _head_parts(
        self, chunks: list[ScheduledChunk]
    ) -> list[tuple[int, int, list[ScheduledChunk]]]:
        """The sampling chunks in consecutive parts whose logits are computed and
        sampled together, each with its first and end row of the sampling rows."""
        sizes = [1 + len(c.draft) for c in chunks]
        starts = [0, *itertools.accumulate(sizes)]
        return [
            (starts[first], starts[end], chunks[first:end])
            for first, end in head_parts(sizes, self._head_rows(starts[-1]))
        ]

    def _head_rows(self, rows: int) -> int:
        """How many of ``rows`` logits rows to hold at once: on the CPU about
        ``HEAD_BYTES`` of float32, in a multiple of ``HEAD_TILE`` rows (at least one
        tile), since a step's logits are its largest tensor (64 rows of a 49,152-token
        vocabulary are 12 MiB); a GPU, all. Each part re-reads the head's weights (64
        rows of the 1.2B model's head took 29 ms at once, 31 in parts of 8), and a part
        that leaves a tile part-empty pays a tile's read for a few rows (42 ms in parts
        of 10 where 64 rows took 35; 2 Zen 4 cores)."""
        if self.device.type != "cpu":
            return max(1, rows)
        fit = HEAD_BYTES // (4 * self.lm.config.vocab_size)
        return max(HEAD_TILE, fit - fit % HEAD_TILE)

    def _begin(self) -> None:
        """Mark where a step's device work begins, its host preparation done (a GPU
        counts its busy time from here; nothing on the CPU)."""

    def _hand_off(self, tokens: torch.Tensor) -> Chosen:
        """Start the tokens' way to the host (the CPU has them already)."""
        return Chosen(tokens, tokens)

    def _wait(self, chosen: Chosen) -> list[int]:
        result: list[int] = chosen.host.tolist()
        return result

    @staticmethod
    def _sample(
        logits: torch.Tensor, chunks: list[ScheduledChunk], rows: Mapping[str, SamplingRow]
    ) -> dict[str, Sampled]:
        """Sample the plain chunks together (one logits row each); verify each
        chunk with a draft on its rows (one per draft token, plus one)."""
        starts, at = [], 0
        for c in chunks:
            starts.append(at)
            at += 1 + len(c.draft)
        plain = [(c, s) for c, s in zip(chunks, starts, strict=True) if not c.draft]
        sampled: dict[str, Sampled] = {}
        if plain:
            # Every row is a plain chunk's in most steps: no gather (a copy) then.
            picked = logits if len(plain) == len(logits) else logits[[s for _, s in plain]]
            out = sample(picked, [rows[c.seq.request_id] for c, _ in plain])
            for (c, _), token, logprobs in zip(plain, out.token_ids, out.logprobs, strict=True):
                sampled[c.seq.request_id] = Sampled(token, logprobs)
        for c, s in zip(chunks, starts, strict=True):
            if c.draft:
                rid = c.seq.request_id
                accepted, token = verify(logits[s : s + 1 + len(c.draft)], c.draft, rows[rid])
                sampled[rid] = Sampled(token, None, tuple(accepted))
        return sampled

    def _prompt_logprobs(
        self,
        step: SchedulerOutput,
        starts: list[int],
        hidden: torch.Tensor,
        wanted: Mapping[str, int],
    ) -> dict[str, PromptLogprobs]:
        """For each wanted chunk, the log-probability of every prompt token its rows
        predict (row at position p predicts prompt token p + 1)."""
        found: dict[str, PromptLogprobs] = {}
        for chunk, row in zip(step.chunks, starts, strict=True):
            seq = chunk.seq
            k = wanted.get(seq.request_id)
            first = seq.num_computed
            last = min(first + chunk.num_tokens, seq.num_prompt_tokens - 1)
            if k is None or last <= first:
                continue
            n = last - first
            entries: list[TokenLogprobs] = []
            for lo, hi in head_parts([1] * n, self._head_rows(n)):
                targets = seq.token_ids[first + 1 + lo : first + 1 + hi]
                entries += self._logprobs_of(hidden[row + lo : row + hi], targets, k)
            found[seq.request_id] = PromptLogprobs(first, entries)
        return found

    def _logprobs_of(self, hidden: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
        """Each row's log-probability of its target token, and its ``k`` most likely."""
        logprobs = torch.log_softmax(self.lm.model.compute_logits(hidden).float(), dim=-1)
        index = torch.tensor(targets, device=logprobs.device)
        chosen = logprobs.gather(1, index[:, None])[:, 0].tolist()
        values, ids = logprobs.topk(k, dim=-1)
        return [
            TokenLogprobs(lp, list(zip(i, v, strict=True)))
            for lp, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)
        ]

    def prepare(self, step: SchedulerOutput, after: Launch | None = None) -> StepInputs:
        """The step's tensors; its input ids may hold pending ids of ``after``
        (``chunk_ids``), which the caller resolves on the device."""
        singles = sorted(
            (c for c in step.chunks if c.num_tokens == 1), key=lambda c: c.seq.num_computed
        )
        chunks = singles + [c for c in step.chunks if c.num_tokens > 1]
        ids: list[int] = []
        positions: list[int] = []
        sample_index: list[int] = []
        sampling: list[ScheduledChunk] = []
        first_row: dict[int, int] = {}
        for chunk in chunks:
            start, n = chunk.seq.num_computed, chunk.num_tokens
            first_row[id(chunk)] = len(ids)
            ids.extend(chunk_ids(chunk, after))
            positions.extend(range(start, start + n))
            if chunk.samples:
                # The last own token's row, then one row per draft token.
                sample_index.extend(range(len(ids) - 1 - len(chunk.draft), len(ids)))
                sampling.append(chunk)
        check_ids(ids, after)
        meta = self._metadata(chunks, len(singles), _full_blocks)
        if self.spec.hybrid_window is not None:
            windowed = self._metadata(chunks, len(singles), windowed_blocks)
            meta = dataclasses.replace(meta, windowed=windowed)
        return StepInputs(
            self._tensor(ids),
            self._tensor(positions),
            meta,
            self._tensor(sample_index),
            sampling,
            [first_row[id(c)] for c in step.chunks],
        )

    def _metadata(
        self, chunks: list[ScheduledChunk], num_singles: int, table: BlocksOf
    ) -> AttentionMetadata:
        """Where the rows of ``chunks`` (their single-token ones first) write and read
        in the pool whose blocks ``table`` gives of each sequence."""
        slots: list[int] = []
        segments: list[PrefillSegment] = []
        row = 0
        for chunk in chunks:
            blocks, start, n = table(chunk.seq), chunk.seq.num_computed, chunk.num_tokens
            if n > 1:
                segments.append(self._segment(chunk, row, blocks))
            slots.extend(slot_of(blocks, pos, self.block_size) for pos in range(start, start + n))
            row += n
        native = None
        groups: tuple[SingleGroup, ...] = ()
        if self.decode_kernel is not None:
            native = self._native(chunks, num_singles, self.decode_kernel, table)
        else:
            groups = tuple(
                self._group(chunks[i : min(i + SINGLE_GROUP, num_singles)], i, table)
                for i in range(0, num_singles, SINGLE_GROUP)
            )
        return AttentionMetadata(self._tensor(slots), groups, tuple(segments), native)

    def _group(self, chunks: list[ScheduledChunk], start: int, table: BlocksOf) -> SingleGroup:
        width = max(self._blocks_covering(c) for c in chunks)
        tables = [table(c.seq)[: self._blocks_covering(c)] for c in chunks]
        padded = self._tensor([t + [0] * (width - len(t)) for t in tables])
        contexts = torch.tensor([c.seq.num_computed + 1 for c in chunks], device=self.device)
        keys = torch.arange(width * self.block_size, device=self.device)
        mask = (keys[None, :] < contexts[:, None])[:, None, None, :]
        return SingleGroup(start, len(chunks), padded, mask)

    def _native(
        self,
        chunks: list[ScheduledChunk],
        num_singles: int,
        kernel: DecodeKernel,
        table: BlocksOf,
    ) -> NativeDecode:
        width = max(self._blocks_covering(c) for c in chunks)
        tables = [table(c.seq)[: self._blocks_covering(c)] for c in chunks]
        padded = self._tensor([t + [0] * (width - len(t)) for t in tables])
        row_seqs: list[int] = []
        contexts: list[int] = []
        for index, chunk in enumerate(chunks):
            start = chunk.seq.num_computed
            row_seqs.extend([index] * chunk.num_tokens)
            contexts.extend(range(start + 1, start + chunk.num_tokens + 1))
        return NativeDecode(
            num_singles, padded, self._tensor(row_seqs), self._tensor(contexts), kernel
        )

    def _blocks_covering(self, chunk: ScheduledChunk) -> int:
        return -(-(chunk.seq.num_computed + chunk.num_tokens) // self.block_size)

    def _segment(self, chunk: ScheduledChunk, start: int, blocks: list[int]) -> PrefillSegment:
        cached, n = chunk.seq.num_computed, chunk.num_tokens
        block_ids = self._tensor(blocks[: self._blocks_covering(chunk)])
        mask = None
        if cached:
            keys = torch.arange(cached + n, device=self.device)
            queries = torch.arange(cached, cached + n, device=self.device)
            mask = keys[None, :] <= queries[:, None]
        return PrefillSegment(start, n, cached, block_ids, mask)

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
