"""The engine's ``Runner`` on a CUDA GPU.

The same steps as ``ModelRunner`` (sampling, prompt log-probabilities, grammars are
its), with the GPU's attention: Triton kernels over the paged cache
(``carpool.models.triton_attention``), rows in the step's own order, one kernel
writing a layer's keys and values. Decode steps replay CUDA graphs
(``decode_graphs``); steps with prompt chunks run eagerly, or with ``prompt_graphs``
from graphs of their own (``prompt_graphs``). The device's busy
time per step is measured with CUDA events (``device_seconds``, from the
moment the step's inputs are prepared on the host to its last kernel), so a benchmark
can report how long the GPU waited on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from carpool.engine.block_manager import slot_of
from carpool.engine.outputs import ScheduledChunk, SchedulerOutput
from carpool.engine.runner import Launch, Sampled, SamplingRow, StepResult
from carpool.models.attention import AttentionMetadata
from carpool.models.causal_lm import LoadedLM
from carpool.models.triton_attention import PagedMetadata, Tiles, prefill_block_q, tiles_for
from carpool.paths import PathTaken
from carpool.workers.decode_graphs import DecodeGraphs
from carpool.workers.model_runner import ModelRunner, windowed_blocks
from carpool.workers.prompt_graphs import PromptGraphs
from carpool.workers.sampler import choose, sample
from carpool.workers.step_tensors import (
    Chosen,
    StepInputs,
    check_ids,
    chunk_ids,
    pending_tokens,
    resolve_pending,
)


class CudaModelRunner(ModelRunner):
    """``ModelRunner`` with paged attention on the GPU and decode steps from graphs."""

    def __init__(
        self,
        lm: LoadedLM,
        num_blocks: int,
        block_size: int,
        paths: tuple[PathTaken, ...],
        max_num_seqs: int,
        max_model_len: int,
        cuda_graphs: bool = True,
        max_passes: int = 1,
        window_blocks: int = 0,
        prompt_graphs: bool = False,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        """``max_num_seqs`` and ``max_model_len`` bound the captured decode steps;
        ``cuda_graphs`` False runs every step eagerly (as it must on the CPU, where
        the tests run this runner's kernels under Triton's interpreter).
        ``max_passes``: the most forward passes of one decode step (multi-step
        decoding, ``EngineConfig.num_scheduler_steps``). ``window_blocks``: a hybrid
        model's windowed pool (``ModelRunner``). ``prompt_graphs``: steps with prompt
        chunks of up to ``max_num_batched_tokens`` run on persistent buffers too,
        replayed from graphs with ``cuda_graphs`` (not for a hybrid model)."""
        super().__init__(lm, num_blocks, block_size, None, paths, window_blocks)
        self.max_blocks = -(-max_model_len // block_size)
        self.block_q = prefill_block_q(lm.config.num_heads // lm.config.num_kv_heads)
        hybrid = self.spec.hybrid_window is not None
        self.decode = DecodeGraphs(
            lm, self.caches, max_num_seqs, self.max_blocks, block_size, max_passes, hybrid
        )
        if cuda_graphs:
            self.decode.capture()
        self.prompts: PromptGraphs | None = None
        if prompt_graphs and not hybrid:
            self.prompts = PromptGraphs(
                lm, self.caches, max_num_batched_tokens, max_num_seqs, self.max_blocks, self.block_q
            )
            if cuda_graphs:
                self.prompts.capture()
        self.multi_step = max_passes > 1
        self.device_seconds = 0.0
        self.steps = 0
        self._begun: torch.cuda.Event | None = None  # this step's device work began

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode steps, where they replay captured CUDA graphs."""
        return self.decode if self.decode.graphs else None

    @torch.inference_mode()
    def execute(
        self,
        step: SchedulerOutput,
        rows: Mapping[str, SamplingRow],
        prompt_logprobs: Mapping[str, int] | None = None,
    ) -> StepResult:
        self._begun = None
        result = self._execute(step, rows, prompt_logprobs)
        self._account(self._begun, self._event())
        return result

    def _execute(
        self,
        step: SchedulerOutput,
        rows: Mapping[str, SamplingRow],
        prompt_logprobs: Mapping[str, int] | None,
    ) -> StepResult:
        if not prompt_logprobs and self.decode.fits(step.chunks):
            return self._decode(step, rows)
        # A mixed step runs eagerly, one token for a chunk with lookahead (its extra
        # slots stay allocated to it for later steps).
        plain = [
            ScheduledChunk(c.seq, c.num_own, c.samples) if c.lookahead else c for c in step.chunks
        ]
        if not prompt_logprobs and self.prompts is not None and self.prompts.fits(plain):
            return self._prompt(SchedulerOutput(plain), rows)
        return super().execute(SchedulerOutput(plain), rows, prompt_logprobs)

    def _prompt(self, step: SchedulerOutput, rows: Mapping[str, SamplingRow]) -> StepResult:
        """A step with prompt chunks on the prompt graphs' buffers: each sampling
        chunk's token."""
        inputs = self.prepare(step)
        logits = self._run_prompt(inputs, None)
        result = StepResult()
        if inputs.sampling_chunks:
            result.sampled = self._sample(logits, inputs.sampling_chunks, rows)
        return result

    def _run_prompt(self, inputs: StepInputs, after: Launch | None) -> torch.Tensor:
        """The logits of a prepared prompt step's sampling rows, from its graph."""
        assert self.prompts is not None
        self._begin()
        size = self.prompts.stage(inputs)
        pending = pending_tokens(after)
        if pending is not None:
            resolve_pending(self.prompts.i64[0, : len(inputs.input_ids)], pending)
        return self.prompts.run(size, len(inputs.sample_index))

    def _decode(self, step: SchedulerOutput, rows: Mapping[str, SamplingRow]) -> StepResult:
        """A decode step on the persistent buffers: each chunk's sampled token, and
        for a chunk with lookahead the greedy tokens of its later passes."""
        chunks = step.chunks
        self.decode.stage(chunks)
        self._begin()
        logits, later = self.decode.run(chunks)
        out = sample(logits, [rows[c.seq.request_id] for c in chunks])
        more = later.tolist() if later is not None else []
        result = StepResult()
        for i, (chunk, token, logprobs) in enumerate(
            zip(chunks, out.token_ids, out.logprobs, strict=True)
        ):
            tokens = [token, *(more[j][i] for j in range(chunk.lookahead))]
            result.sampled[chunk.seq.request_id] = Sampled(tokens[-1], logprobs, tuple(tokens[:-1]))
        return result

    def _launch_tokens(
        self, step: SchedulerOutput, rows: Mapping[str, SamplingRow], after: Launch | None
    ) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        self._begun = None
        if self.decode.fits(step.chunks):
            self.decode.stage(step.chunks, after)
            self._begin()
            logits, _ = self.decode.run(step.chunks, pending_tokens(after))
            chunks = list(step.chunks)
        elif self.prompts is not None and self.prompts.fits(step.chunks):
            inputs = self.prepare(step, after)
            logits, chunks = self._run_prompt(inputs, after), inputs.sampling_chunks
        else:
            return super()._launch_tokens(step, rows, after)
        return choose(logits, [rows[c.seq.request_id] for c in chunks]), chunks

    def _begin(self) -> None:
        self._begun = self._event()

    def _event(self) -> torch.cuda.Event | None:
        """An event recorded now on the GPU's stream (None on the CPU, where the tests
        run this runner's kernels interpreted)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _hand_off(self, tokens: torch.Tensor) -> Chosen:
        """Queue the tokens' copy to pinned host memory and an event after it, so
        landing waits for this step alone, not for one launched after it."""
        if self._begun is None:
            return Chosen(tokens, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        return Chosen(tokens, host, self._begun, self._event())

    def _wait(self, chosen: Chosen) -> list[int]:
        self._account(chosen.start, chosen.end)
        return super()._wait(chosen)

    def _account(self, start: torch.cuda.Event | None, end: torch.cuda.Event | None) -> None:
        """Wait for a step's ``end`` and add its busy time, ``start`` to ``end`` on the
        device (nothing on the CPU, where both are None)."""
        if start is None or end is None:
            return
        end.synchronize()
        self.device_seconds += start.elapsed_time(end) / 1000
        self.steps += 1

    def prepare(self, step: SchedulerOutput, after: Launch | None = None) -> StepInputs:
        """The step's rows in its chunks' order, with the Triton kernels' metadata (a
        hybrid model's windowed layers' own beside it)."""
        bs = self.block_size
        tokens: list[list[int]] = [[], [], [], []]  # ids, positions, slots, windowed slots
        ids, positions, slots, window_slots = tokens
        sample_index: list[int] = []
        chunk_starts: list[int] = []
        query_start, seq_lens, tables, window_tables = [0], [], [], []
        hybrid = self.spec.hybrid_window is not None
        for chunk in step.chunks:
            seq, start, n = chunk.seq, chunk.seq.num_computed, chunk.num_tokens
            chunk_starts.append(len(ids))
            blocks = seq.block_table.blocks
            slots.extend(slot_of(blocks, p, bs) for p in range(start, start + n))
            if hybrid:
                windowed = windowed_blocks(seq)
                window_slots.extend(slot_of(windowed, p, bs) for p in range(start, start + n))
                window_tables.append(windowed[: self._blocks_covering(chunk)])
            ids.extend(chunk_ids(chunk, after))
            positions.extend(range(start, start + n))
            if chunk.samples:
                # The last own token's row, then one row per draft token.
                sample_index.extend(range(len(ids) - 1 - len(chunk.draft), len(ids)))
            query_start.append(len(ids))
            seq_lens.append(start + n)
            tables.append(blocks[: self._blocks_covering(chunk)])
        check_ids(ids, after)
        width = max(len(t) for t in tables)
        rows_per_seq = [c.num_tokens for c in step.chunks]
        tile_seq, tile_row, tile_end = tiles_for(rows_per_seq, seq_lens, self.block_q)
        # Two uploads: the int64 rows, then every int32 array in one buffer.
        i64 = torch.tensor(tokens if hybrid else tokens[:3], dtype=torch.int64)
        i64 = i64.to(self.device, non_blocking=True)
        arrays = [query_start, seq_lens, tile_seq, tile_row, tile_end]
        arrays += [_padded(tables, width), _padded(window_tables, width)]
        flat, bounds = _aligned(arrays)
        i32 = torch.tensor(flat, dtype=torch.int32).to(self.device, non_blocking=True)
        parts = [i32[a:b] for a, b in bounds]
        paged = PagedMetadata(
            slot_mapping=i64[2],
            block_tables=parts[5].view(len(step.chunks), width),
            query_start=parts[0],
            seq_lens=parts[1],
            tiles=Tiles(parts[2], parts[3], parts[4]),
        )
        windowed_meta = None
        if hybrid:
            window_paged = dataclasses.replace(
                paged, slot_mapping=i64[3], block_tables=parts[6].view(len(step.chunks), width)
            )
            windowed_meta = AttentionMetadata(i64[3], (), (), None, window_paged)
        meta = AttentionMetadata(paged.slot_mapping, (), (), None, paged, windowed_meta)
        return StepInputs(
            i64[0],
            i64[1],
            meta,
            torch.tensor(sample_index, dtype=torch.long).to(self.device, non_blocking=True),
            [c for c in step.chunks if c.samples],
            chunk_starts,
        )


def _padded(tables: list[list[int]], width: int) -> list[int]:
    """Block tables row by row, each padded with block 0 to ``width``."""
    return [b for t in tables for b in (*t, *[0] * (width - len(t)))]


def _aligned(arrays: list[list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """``arrays`` end to end, each starting on 16 bytes (4 int32s), and where each
    lies: Triton compiles a kernel variant per pointer alignment, so every step's
    pointers keep the same one."""
    flat: list[int] = []
    bounds: list[tuple[int, int]] = []
    for values in arrays:
        flat.extend([0] * (-len(flat) % 4))
        bounds.append((len(flat), len(flat) + len(values)))
        flat.extend(values)
    return flat, bounds
