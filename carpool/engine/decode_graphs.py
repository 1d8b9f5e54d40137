"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step (every sequence runs one token, none needs prompt log-probabilities)
of n sequences runs the graph of the smallest bucket >= n: its inputs are
persistent device buffers that the step's values are copied into (two copies, from
pinned host memory), its padding rows store nothing (slot -1) and attend nothing
(context 0). The graph holds the whole forward pass and the logits of every row;
sampling stays outside (each row's own parameters). Graphs share one memory pool,
which is safe because one runs at a time and its logits are read before the next.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from carpool.engine.outputs import ScheduledChunk
from carpool.models.attention import AttentionMetadata
from carpool.models.causal_lm import LoadedLM
from carpool.models.triton_attention import PagedMetadata

log = logging.getLogger(__name__)


def buckets_up_to(max_batch: int) -> list[int]:
    """vLLM's sizes: 1, 2, 4, 8, then every 8 up to 64, every 16 after; and
    ``max_batch`` itself."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, max_batch + 1, 16)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    """Captured decode steps for up to ``max_batch`` sequences of up to
    ``max_blocks`` KV blocks each."""

    def __init__(
        self,
        lm: LoadedLM,
        caches: list[torch.Tensor],
        max_batch: int,
        max_blocks: int,
        block_size: int,
    ) -> None:
        device = lm.device
        self.lm = lm
        self.caches = caches
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.buckets = buckets_up_to(max_batch)
        # ids, positions, slots; then seq_lens and the block tables, row by row.
        self.host_i64 = torch.zeros(3, max_batch, dtype=torch.int64).pin_memory()
        self.host_i32 = torch.zeros(max_batch * (1 + max_blocks), dtype=torch.int32).pin_memory()
        self.dev_i64 = torch.zeros(3, max_batch, dtype=torch.int64, device=device)
        self.dev_i32 = torch.zeros(max_batch * (1 + max_blocks), dtype=torch.int32, device=device)
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def fits(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether a step of ``chunks`` can replay a graph."""
        return (
            0 < len(chunks) <= self.max_batch
            and all(c.num_tokens == 1 and not c.draft and c.samples for c in chunks)
            and all(len(c.seq.block_table.blocks) <= self.max_blocks for c in chunks)
        )

    def capture(self) -> None:
        """Capture one graph per bucket, largest first (the smaller ones reuse its
        pool); logs the time and the pool's size."""
        started = time.perf_counter()
        before = torch.cuda.memory_reserved(self.lm.device)
        pool = None
        self._pad(0, self.max_batch)
        self._upload(self.max_batch)
        with torch.inference_mode():
            for size in reversed(self.buckets):
                meta = self._meta(size)
                self._forward(size, meta)  # compiles the kernels, warms cuBLAS
                torch.cuda.synchronize(self.lm.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(size, meta)
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.lm.device)
        self.capture_seconds = time.perf_counter() - started
        grown = (torch.cuda.memory_reserved(self.lm.device) - before) / 2**20
        log.info(
            "captured %d decode graphs (batch sizes %s) in %.2f s, %.0f MiB",
            len(self.graphs),
            ", ".join(map(str, self.buckets)),
            self.capture_seconds,
            grown,
        )

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Replay the step of ``chunks`` (``fits``); the logits [len(chunks), vocab],
        row i for chunk i."""
        n = len(chunks)
        size = next(b for b in self.buckets if b >= n)
        self._fill(chunks)
        self._pad(n, size)
        self._upload(size)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]

    def _fill(self, chunks: Sequence[ScheduledChunk]) -> None:
        i64 = self.host_i64.numpy()
        i32 = self.host_i32.numpy()
        lens = i32[: self.max_batch]
        tables = i32[self.max_batch :].reshape(self.max_batch, self.max_blocks)
        bs = self.block_size
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            position = seq.num_computed
            blocks = seq.block_table.blocks
            i64[0, i] = seq.token_ids[position]
            i64[1, i] = position
            i64[2, i] = blocks[position // bs] * bs + position % bs
            lens[i] = position + 1
            tables[i, : len(blocks)] = blocks

    def _pad(self, start: int, end: int) -> None:
        i64 = self.host_i64.numpy()
        i64[0:2, start:end] = 0
        i64[2, start:end] = -1
        self.host_i32.numpy()[start:end] = 0

    def _upload(self, size: int) -> None:
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        used = self.max_batch + size * self.max_blocks
        self.dev_i32[:used].copy_(self.host_i32[:used], non_blocking=True)

    def _meta(self, size: int) -> AttentionMetadata:
        tables = self.dev_i32[self.max_batch :].view(self.max_batch, self.max_blocks)
        paged = PagedMetadata(
            slot_mapping=self.dev_i64[2, :size],
            block_tables=tables[:size],
            query_start=self.query_start[: size + 1],
            seq_lens=self.dev_i32[:size],
        )
        return AttentionMetadata(paged.slot_mapping, (), (), None, paged)

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        model = self.lm.model
        hidden = model(self.dev_i64[0, :size], self.dev_i64[1, :size], self.caches, meta)
        return model.compute_logits(hidden)
