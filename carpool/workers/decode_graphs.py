"""Decode steps over persistent device buffers, replayed from CUDA graphs (one graph
per batch-size bucket), with multi-step decoding.

A decode step (every sequence runs one token, none needs prompt log-probabilities)
of n sequences runs at the smallest bucket >= n: its inputs are copied into
persistent device buffers (two copies, from pinned host memory on a GPU), its padding
rows store nothing (slot -1) and attend nothing (context 0). Each pass holds the
whole forward pass and the logits of every row; sampling stays outside (each row's
own parameters). A row with ``lookahead`` L runs L more passes, each fed the
previous pass's greedy token on the device; the host sees all of them after one
synchronisation. Graphs share one memory pool, which is safe because one runs at a
time and its logits are read (or copied) before the next. Without graphs (``capture``
not called: the CPU under the tests' interpreter, or graphs turned off) the same
buffers feed an eager forward pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from carpool.engine.block_manager import slot_of
from carpool.engine.outputs import ScheduledChunk
from carpool.engine.runner import Launch
from carpool.models.attention import AttentionMetadata
from carpool.models.causal_lm import LoadedLM
from carpool.models.triton_attention import PagedMetadata
from carpool.workers.model_runner import windowed_blocks
from carpool.workers.step_tensors import first_ids, resolve_pending

log = logging.getLogger(__name__)


def buckets_up_to(max_batch: int) -> list[int]:
    """vLLM's sizes: 1, 2, 4, 8, then every 8 up to 64, every 16 after; and
    ``max_batch`` itself."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, max_batch + 1, 16)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def capture_graphs(
    device: torch.device,
    buckets: list[int],
    forward: Callable[[int], torch.Tensor],
    what: str,
    unit: str,
) -> tuple[dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]], float]:
    """One CUDA graph of ``forward(size)`` per bucket, largest first (the smaller ones
    reuse its memory pool, safe since one graph runs at a time), each after a run of
    its own that compiles the kernels and warms cuBLAS; with the seconds it took. Logs
    ``what`` was captured, the buckets (in ``unit``) and how much the pool grew."""
    started = time.perf_counter()
    before = torch.cuda.memory_reserved(device)
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    pool = None
    with torch.inference_mode():
        for size in reversed(buckets):
            forward(size)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(size)
            pool = graph.pool()
            graphs[size] = (graph, out)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    grown = (torch.cuda.memory_reserved(device) - before) / 2**20
    log.info(
        "captured %d %s (%s %s) in %.2f s, %.0f MiB",
        len(graphs),
        what,
        unit,
        ", ".join(map(str, buckets)),
        seconds,
        grown,
    )
    return graphs, seconds


class DecodeGraphs:
    """Decode steps for up to ``max_batch`` sequences of up to ``max_blocks`` KV
    blocks each, and up to ``max_passes`` passes a step."""

    def __init__(
        self,
        lm: LoadedLM,
        caches: list[torch.Tensor],
        max_batch: int,
        max_blocks: int,
        block_size: int,
        max_passes: int = 1,
        hybrid: bool = False,
    ) -> None:
        """``hybrid``: the model's windowed layers keep their KV in a pool of their
        own, with slots and block tables of their own (``ModelRunner``)."""
        device = lm.device
        self.hybrid = hybrid
        self.lm = lm
        self.caches = caches
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.max_passes = max_passes
        self.buckets = buckets_up_to(max_batch)
        pinned = device.type == "cuda"

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            tensor = torch.zeros(*shape, dtype=dtype)
            return tensor.pin_memory() if pinned else tensor

        # ids, positions, slots (and a hybrid model's windowed slots); then seq_lens
        # and the block tables, row by row (then the windowed ones). Two sets, used in
        # turn: with asynchronous scheduling a step is filled while the last one's
        # upload may still wait in the stream (``_staged`` waits for the upload before
        # last, long done).
        rows, pools = (4, 2) if hybrid else (3, 1)
        self.staging = [
            (
                host(rows, max_batch, dtype=torch.int64),
                host(max_batch * (1 + pools * max_blocks), dtype=torch.int32),
            )
            for _ in range(2)
        ]
        self.uploads: list[torch.cuda.Event | None] = [None, None]
        self.host_i64, self.host_i32 = self.staging[0]
        self.dev_i64 = torch.zeros(rows, max_batch, dtype=torch.int64, device=device)
        self.dev_i32 = torch.zeros(
            max_batch * (1 + pools * max_blocks), dtype=torch.int32, device=device
        )
        # Passes after the first: positions and slots (windowed too), and seq_lens.
        more = max(max_passes - 1, 1)
        self.host_more_i64 = host(more, rows - 1, max_batch, dtype=torch.int64)
        self.host_more_i32 = host(more, max_batch, dtype=torch.int32)
        self.dev_more_i64 = torch.zeros_like(self.host_more_i64, device=device)
        self.dev_more_i32 = torch.zeros_like(self.host_more_i32, device=device)
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def fits(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether a step of ``chunks`` can run here: one own token each, sampling,
        with no draft to verify (lookahead is fine, up to ``max_passes``)."""
        return 0 < len(chunks) <= self.max_batch and all(
            c.samples
            and not c.draft
            and c.num_own == 1
            and c.lookahead < self.max_passes
            and len(c.seq.block_table.blocks) <= self.max_blocks
            for c in chunks
        )

    def capture(self) -> None:
        """Capture one graph per bucket (``capture_graphs``), on inputs that are all
        padding."""
        self._pad(0, self.max_batch)
        self._upload(self.max_batch)
        self.graphs, self.capture_seconds = capture_graphs(
            self.lm.device,
            self.buckets,
            lambda size: self._forward(size, self._meta(size)),
            "decode graphs",
            "batch sizes",
        )

    def stage(self, chunks: Sequence[ScheduledChunk], after: Launch | None = None) -> None:
        """The host's half of the step of ``chunks`` (``fits``): its rows into host
        memory, the device's work not started (``run`` starts it)."""
        n = len(chunks)
        self._staged()
        self._fill(chunks, after)
        self._pad(n, self._bucket(n))

    def run(
        self, chunks: Sequence[ScheduledChunk], pending: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the step of ``chunks``, staged (``stage``): the first pass's logits [n,
        vocab] (row i for chunk i), and the greedy tokens of the later passes
        [passes - 1, n] (row j - 1 for pass j; None when every chunk has no
        lookahead). A chunk's tokens past its own lookahead are padding's, to be
        ignored. ``pending``: the tokens of the step in flight, which a pending id
        (``step_tensors.pending_id``) stands for."""
        n = len(chunks)
        size = self._bucket(n)
        lookahead = [c.lookahead for c in chunks]
        passes = 1 + max(lookahead)
        self._upload(size)
        if pending is not None:
            resolve_pending(self.dev_i64[0, :n], pending)
        if passes > 1:
            self._plan_passes(chunks, lookahead, passes)
        logits = self._pass(size)[:n]
        if passes == 1:
            return logits, None
        first = logits.clone()  # the next pass writes the same buffer
        token = first.float().argmax(dim=-1)
        later = []
        for j in range(passes - 1):
            self.dev_i64[0, :n].copy_(token)
            self.dev_i64[1:].copy_(self.dev_more_i64[j])
            self.dev_i32[: self.max_batch].copy_(self.dev_more_i32[j])
            token = self._pass(size)[:n].float().argmax(dim=-1)
            later.append(token)
        return first, torch.stack(later)

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _pass(self, size: int) -> torch.Tensor:
        if self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits
        return self._forward(size, self._meta(size))

    def _tables(self, buffer: torch.Tensor, pool: int) -> torch.Tensor:
        """The block tables of ``pool`` (1: the windowed one) in an int32 buffer,
        host or device."""
        start = self.max_batch * (1 + pool * self.max_blocks)
        end = start + self.max_batch * self.max_blocks
        return buffer[start:end].view(self.max_batch, self.max_blocks)

    def _fill(self, chunks: Sequence[ScheduledChunk], after: Launch | None) -> None:
        """Stage the step's rows: ids (a pending token's as its ``pending_id`` in
        ``after``), positions, slots and lengths a row of the buffer each (one copy
        from a list: element by element cost ~0.5 us a sequence), then each
        sequence's block table."""
        seqs = [c.seq for c in chunks]
        n, bs = len(seqs), self.block_size
        positions = [s.num_computed for s in seqs]
        i64 = self.host_i64.numpy()
        i64[0, :n] = first_ids(chunks, after)
        i64[1, :n] = positions
        i64[2, :n] = [
            slot_of(s.block_table.blocks, p, bs) for s, p in zip(seqs, positions, strict=True)
        ]
        self.host_i32.numpy()[:n] = [p + 1 for p in positions]
        tables = self._tables(self.host_i32, 0).numpy()
        for i, seq in enumerate(seqs):
            blocks = seq.block_table.blocks
            tables[i, : len(blocks)] = blocks
        if self.hybrid:
            window_tables = self._tables(self.host_i32, 1).numpy()
            for i, (seq, position) in enumerate(zip(seqs, positions, strict=True)):
                windowed = windowed_blocks(seq)
                i64[3, i] = slot_of(windowed, position, bs)
                window_tables[i, : len(windowed)] = windowed

    def _plan_passes(
        self, chunks: Sequence[ScheduledChunk], lookahead: list[int], passes: int
    ) -> None:
        """Each later pass's positions, slots and context lengths, uploaded at once;
        a row past its lookahead is padding there."""
        more_i64 = self.host_more_i64.numpy()
        more_i32 = self.host_more_i32.numpy()
        bs = self.block_size
        more_i64[: passes - 1, 0] = 0
        more_i64[: passes - 1, 1] = -1
        more_i32[: passes - 1] = 0
        if self.hybrid:
            more_i64[: passes - 1, 2] = -1
        for i, chunk in enumerate(chunks):
            first = chunk.seq.num_computed
            blocks = chunk.seq.block_table.blocks
            windowed = windowed_blocks(chunk.seq) if self.hybrid else None
            for j in range(1, lookahead[i] + 1):
                position = first + j
                more_i64[j - 1, 0, i] = position
                more_i64[j - 1, 1, i] = slot_of(blocks, position, bs)
                more_i32[j - 1, i] = position + 1
                if windowed is not None:
                    more_i64[j - 1, 2, i] = slot_of(windowed, position, bs)
        self.dev_more_i64[: passes - 1].copy_(self.host_more_i64[: passes - 1], non_blocking=True)
        self.dev_more_i32[: passes - 1].copy_(self.host_more_i32[: passes - 1], non_blocking=True)

    def _pad(self, start: int, end: int) -> None:
        i64 = self.host_i64.numpy()
        i64[0:2, start:end] = 0
        i64[2:, start:end] = -1  # slots, windowed ones too
        self.host_i32.numpy()[start:end] = 0

    def _staged(self) -> None:
        """Take the staging set not used last, once its last upload has left it."""
        self.staging.reverse()
        self.uploads.reverse()
        self.host_i64, self.host_i32 = self.staging[0]
        if self.uploads[0] is not None:
            self.uploads[0].synchronize()

    def _upload(self, size: int) -> None:
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        used = self.max_batch + size * self.max_blocks
        self.dev_i32[:used].copy_(self.host_i32[:used], non_blocking=True)
        if self.hybrid:
            self._tables(self.dev_i32, 1)[:size].copy_(
                self._tables(self.host_i32, 1)[:size], non_blocking=True
            )
        if self.dev_i64.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self.uploads[0] = event

    def _meta(self, size: int) -> AttentionMetadata:
        paged = PagedMetadata(
            slot_mapping=self.dev_i64[2, :size],
            block_tables=self._tables(self.dev_i32, 0)[:size],
            query_start=self.query_start[: size + 1],
            seq_lens=self.dev_i32[:size],
        )
        windowed = None
        if self.hybrid:
            window_paged = PagedMetadata(
                slot_mapping=self.dev_i64[3, :size],
                block_tables=self._tables(self.dev_i32, 1)[:size],
                query_start=paged.query_start,
                seq_lens=paged.seq_lens,
            )
            windowed = AttentionMetadata(window_paged.slot_mapping, (), (), None, window_paged)
        return AttentionMetadata(paged.slot_mapping, (), (), None, paged, windowed)

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        model = self.lm.model
        hidden = model(self.dev_i64[0, :size], self.dev_i64[1, :size], self.caches, meta)
        return model.compute_logits(hidden)
