"""Steps that run prompt chunks (prefill, or prompts beside decodes), replayed from CUDA
graphs: one graph per token-count bucket, every graph for up to ``max_seqs`` sequences.

Run eagerly such a step launches every kernel of the forward pass from Python; over
HTTP, where requests arrive at their own times, 4-5% of the steps are such steps, and
on an H200 (session 35) the inter-token latency's p99 of 13-28 ms, against a 2 ms
decode step from a graph, points at what they cost every running stream. Here the
step's inputs, laid out by ``CudaModelRunner.prepare`` (rows grouped by sequence, the
prefill kernel's tile list), are copied into persistent device buffers at the
smallest bucket >= its token count and padded: padding rows store nothing (slot -1)
and belong to no sequence, padding tiles start past every sequence's rows and see no
key (so no tile reads a sequence past the step's), and padding logits rows read row 0.
The graph holds the forward pass and the logits of ``max_seqs`` rows; sampling stays
outside. Without graphs (``capture`` not called: the CPU under the tests' interpreter)
the same buffers feed an eager forward pass.

Not for a hybrid model's windowed pool, drafts to verify or prompt log-probabilities
(``fits``): those steps run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from carpool.engine.outputs import ScheduledChunk
from carpool.models.attention import AttentionMetadata
from carpool.models.causal_lm import LoadedLM
from carpool.models.triton_attention import PagedMetadata, Tiles
from carpool.workers.decode_graphs import capture_graphs
from carpool.workers.step_tensors import StepInputs


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from 64, and ``max_tokens`` itself."""
    sizes = [1 << k for k in range(6, 16) if 1 << k < max_tokens]
    return [*sizes, max_tokens]


class PromptGraphs:
    """Prompt steps of up to ``max_tokens`` tokens over up to ``max_seqs`` sequences of
    up to ``max_blocks`` KV blocks, the prefill kernel's tiles ``block_q`` rows each."""

    def __init__(
        self,
        lm: LoadedLM,
        caches: list[torch.Tensor],
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
        block_q: int,
    ) -> None:
        device = lm.device
        self.lm = lm
        self.caches = caches
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks
        self.buckets = token_buckets(max_tokens)
        # A sequence's tiles cover its rows, the last one partly: at most
        # tokens / block_q + sequences in all, for a bucket of that many tokens.
        self.tiles = {size: -(-size // block_q) + max_seqs for size in self.buckets}
        self.max_tiles = self.tiles[max_tokens]

        def i32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        self.i64 = torch.zeros(3, max_tokens, dtype=torch.int64, device=device)  # ids, pos, slots
        self.query_start = i32(max_seqs + 1)
        self.seq_lens = i32(max_seqs)
        self.tile_seq = i32(self.max_tiles)
        self.tile_row = i32(self.max_tiles)
        self.tile_end = i32(self.max_tiles)
        self.tables = i32(max_seqs * max_blocks).view(max_seqs, max_blocks)
        self.sample_index = torch.zeros(max_seqs, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def fits(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether a step of ``chunks`` can run here: no draft to verify, within the
        buffers' bounds (the caller leaves out hybrid models and prompt log-probs)."""
        return (
            0 < len(chunks) <= self.max_seqs
            and sum(c.num_tokens for c in chunks) <= self.max_tokens
            and all(
                not c.draft and len(c.seq.block_table.blocks) <= self.max_blocks for c in chunks
            )
        )

    def capture(self) -> None:
        """Capture one graph per bucket (``capture_graphs``), on inputs that are all
        padding (padded at the largest bucket, so at every smaller one too)."""
        self._pad(0, 0, 0, self.max_tokens)
        self.graphs, self.capture_seconds = capture_graphs(
            self.lm.device, self.buckets, self._forward, "prompt-step graphs", "tokens"
        )

    def stage(self, inputs: StepInputs) -> int:
        """Copy a step's inputs (``prepare``'s, for chunks that ``fits``) into the
        buffers and pad them to its bucket; returns the bucket. Device-side copies
        only: nothing waits for the host."""
        paged = inputs.meta.device
        assert isinstance(paged, PagedMetadata) and paged.tiles is not None
        tokens, seqs = len(inputs.input_ids), len(paged.seq_lens)
        tiles, samples = len(paged.tiles.seq), len(inputs.sample_index)
        size = next(b for b in self.buckets if b >= tokens)
        self.i64[0, :tokens].copy_(inputs.input_ids)
        self.i64[1, :tokens].copy_(inputs.positions)
        self.i64[2, :tokens].copy_(paged.slot_mapping)
        self.query_start[: seqs + 1].copy_(paged.query_start)
        self.seq_lens[:seqs].copy_(paged.seq_lens)
        self.tile_seq[:tiles].copy_(paged.tiles.seq)
        self.tile_row[:tiles].copy_(paged.tiles.row)
        self.tile_end[:tiles].copy_(paged.tiles.end)
        width = paged.block_tables.shape[1]
        self.tables[:seqs, :width].copy_(paged.block_tables)
        self.sample_index[:samples].copy_(inputs.sample_index)
        self._pad(tokens, tiles, samples, size)
        return size

    def run(self, size: int, samples: int) -> torch.Tensor:
        """Run the staged step at bucket ``size``: the logits [samples, vocab] of its
        sampling rows, in ``sample_index`` order."""
        if self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
        else:
            logits = self._forward(size)
        return logits[:samples]

    def _pad(self, tokens: int, tiles: int, samples: int, size: int) -> None:
        """Rows, tiles and logits rows past the step's: padding. The sequences past its
        own keep whatever they held: no tile of the step reads them."""
        self.i64[0:2, tokens:size] = 0
        self.i64[2, tokens:size] = -1
        # A padding tile starts past any sequence's rows (none is valid) and sees no key.
        self.tile_seq[tiles:] = 0
        self.tile_row[tiles:] = self.max_tokens
        self.tile_end[tiles:] = 0
        self.sample_index[samples:] = 0

    def _meta(self, size: int) -> AttentionMetadata:
        tiles = self.tiles[size]
        paged = PagedMetadata(
            slot_mapping=self.i64[2, :size],
            block_tables=self.tables,
            query_start=self.query_start,
            seq_lens=self.seq_lens,
            tiles=Tiles(self.tile_seq[:tiles], self.tile_row[:tiles], self.tile_end[:tiles]),
        )
        return AttentionMetadata(paged.slot_mapping, (), (), None, paged)

    def _forward(self, size: int) -> torch.Tensor:
        model = self.lm.model
        hidden = model(self.i64[0, :size], self.i64[1, :size], self.caches, self._meta(size))
        return model.compute_logits(hidden[self.sample_index])
