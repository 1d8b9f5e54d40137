"""A Llama-family model's whole decoder stack for one engine step, in one native
call (``kernels/llama_stack.c``).

A decode step of one or a few streams on the CPU spends as long in the several
hundred torch calls of its small operations (norms, rotary, residuals, the cache
write) as in its matrix products; a step with prompt chunks spends a fifth of its
time in torch's element-wise passes over large intermediates. The fused stack runs
the same arithmetic, over the same quantized blocks, without them. Every row of the
step attends its own sequence's cache up to its own position: a decode row with the
decode-attention code, the rows of a prompt chunk together over their keys gathered
once (``kernels/prefill_attention.h``). It is used when every linear layer of every
decoder layer has its blocks and attention is native; otherwise the model runs layer
by layer in torch.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from carpool.models.attention import AttentionMetadata, NativeDecode
from carpool.models.decode_kernel import NATIVE_KV_DTYPES
from carpool.models.native import (
    KernelUnavailable,
    check_shape,
    check_tensors,
    load_library,
)
from carpool.models.packed_linear import (
    KIND_CODES,
    MAX_PARTS,
    InterleavedWeightStruct,
    Linear,
    PackedWeight,
    QuantizedLinearKernel,
    interleaved_structs,
    packed_parts,
)
from carpool.models.rope import RotaryEmbedding


class _FilePart(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("quants", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("k_supers", ctypes.c_void_p),
        ("k_factors", ctypes.c_void_p),
        ("n", ctypes.c_int64),
    ]


class _Matrix(ctypes.Structure):
    _fields_ = [
        ("fparts", ctypes.c_int64),
        ("file", _FilePart * MAX_PARTS),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("iparts", ctypes.c_int64),
        ("interleaved", InterleavedWeightStruct * MAX_PARTS),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p),
        ("qkv", _Matrix),
        ("o", _Matrix),
        ("gate_up", _Matrix),
        ("down", _Matrix),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("window", ctypes.c_int64),
        ("local_rope", ctypes.c_int64),
    ]


class _Step(ctypes.Structure):
    """kernels/llama_stack.c's Step: a step's rows and what they index."""

    _fields_ = [
        ("positions", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("rope_rows", ctypes.c_int64),
        ("local_cos", ctypes.c_void_p),
        ("local_sin", ctypes.c_void_p),
        ("local_rope_rows", ctypes.c_int64),
        ("slots", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("num_seqs", ctypes.c_int64),
        ("max_blocks", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("window_slots", ctypes.c_void_p),
        ("window_block_tables", ctypes.c_void_p),
        ("window_max_blocks", ctypes.c_int64),
        ("window_num_blocks", ctypes.c_int64),
        ("row_seqs", ctypes.c_void_p),
        ("context_lens", ctypes.c_void_p),
    ]


# What the C side returns for an index outside what it indexes (check_step), and the
# array's name
_BAD_INDEX = {
    2: "positions",
    3: "slots",
    4: "block_tables",
    5: "row_seqs",
    6: "context_lens",
    7: "window slots",
    8: "window block_tables",
    9: "context_lens (windowed)",
}


class _Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("int8_dots", ctypes.c_int64),
        ("gelu", ctypes.c_int64),
        ("kv_half", ctypes.c_int64),
    ]


@functools.cache
def _function() -> Any:
    library = load_library("llama_stack")
    function = library.llama_stack
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_void_p,  # layers
        ctypes.c_int64,  # num_layers
        ctypes.c_void_p,  # dims
        ctypes.c_void_p,  # x
        ctypes.c_int64,  # rows
        ctypes.c_void_p,  # step
        ctypes.c_void_p,  # final_norm
        ctypes.c_int,  # num_threads
    ]
    sizes = library.llama_stack_struct_size
    sizes.restype, sizes.argtypes = ctypes.c_int64, [ctypes.c_int64]
    for which, struct in enumerate((_Matrix, _Layer, _Dims, _Step)):
        if sizes(which) != ctypes.sizeof(struct):
            raise KernelUnavailable(
                f"llama_stack's {struct.__name__[1:]} is {sizes(which)} bytes in C and "
                f"{ctypes.sizeof(struct)} as declared here"
            )
    return function


def _matrix(linear: Linear, int8_dots: bool) -> _Matrix:
    """``linear``'s blocks for the C side: the file's layout, its interleaved copy (or
    its parts') or both; a layer that kept only the interleaved copy runs on int8 dot
    products. The pointers are into the layer's tensors, which the stack keeps."""
    packed, interleaved = linear.packed, linear.interleaved
    parts: Sequence[InterleavedWeightStruct] = []
    if interleaved is not None:
        parts = interleaved_structs(interleaved)
    if packed is None:
        if interleaved is None or not int8_dots:
            raise ValueError("a layer with only interleaved blocks needs int8 dot products")
        file_parts: tuple[PackedWeight, ...] = ()
        shape = interleaved.shape
    else:
        file_parts, shape = packed_parts(packed), packed.shape
        if not 1 <= len(file_parts) <= MAX_PARTS or len({p.shape[1] for p in file_parts}) != 1:
            raise ValueError(f"1 to {MAX_PARTS} parts of one k are needed")
        for part in file_parts:
            QuantizedLinearKernel.check_blocks(part)
    n, k = shape
    matrix = _Matrix(len(file_parts))
    for i, part in enumerate(file_parts):
        matrix.file[i] = _file_part(part)
    matrix.bias = _pointer(None if linear.bias is None else linear.bias.detach())
    matrix.n, matrix.k, matrix.iparts = n, k, len(parts)
    for i, iparts in enumerate(parts):
        matrix.interleaved[i] = iparts
    return matrix


def _file_part(packed: PackedWeight) -> _FilePart:
    """One part in the file's layout for the C side (checked by the caller): its
    float32 scales, or a ``lean`` weight's K-quant scales."""
    k_scales = packed.k_scales if packed.is_lean else None
    return _FilePart(
        KIND_CODES[packed.kind],
        packed.quants.data_ptr(),
        _pointer(packed.scales),
        _pointer(packed.mins),
        _pointer(None if k_scales is None else k_scales.supers),
        _pointer(None if k_scales is None else k_scales.factors),
        packed.shape[0],
    )


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights, as the stack reads them: ``q_norm`` and
    ``k_norm`` ([head_dim]) where each head's query and key are normed (Qwen3, Gemma
    3), ``attn_out_norm`` and ``mlp_out_norm`` ([hidden]) where the attention's and
    the MLP's outputs are normed before their residual (Gemma 3), ``window`` where the
    layer attends a sliding window, ``local_rope`` where its rotary factors come from
    the shape's ``local_rope``. Every norm multiplies by its weight as given (Gemma's
    1 + weight is summed by the model)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    window: int | None = None
    local_rope: bool = False

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _check_layer(layer: LayerWeights, shape: StackShape) -> None:
    """Raise ValueError unless the layer's norms are what the C side reads."""
    if (layer.q_norm is None) != (layer.k_norm is None):
        raise ValueError("a layer with a query norm needs a key norm, and the reverse")
    hidden, head = shape.hidden_size, shape.head_dim
    norms = {
        "input_norm": (layer.input_norm, hidden),
        "post_norm": (layer.post_norm, hidden),
        "q_norm": (layer.q_norm, head),
        "k_norm": (layer.k_norm, head),
        "attn_out_norm": (layer.attn_out_norm, hidden),
        "mlp_out_norm": (layer.mlp_out_norm, hidden),
    }
    for name, (norm, size) in norms.items():
        if norm is None:
            if name in ("input_norm", "post_norm"):  # every layer has these two
                raise ValueError(f"a layer without its {name}")
            continue
        check_tensors(**{name: (norm, torch.float32)})
        check_shape(name, norm, size)
    if layer.window is not None and layer.window < 1:
        raise ValueError(f"a sliding window of {layer.window} tokens")
    if layer.local_rope and shape.local_rope is None:
        raise ValueError("a layer reads local rotary factors the shape does not have")


@dataclass(frozen=True)
class StackShape:
    """The model's sizes, its attention's scale, its rotary tables and the weight of
    its final norm (as the layers' norms, multiplied by as given: Gemma's ``1 +
    weight``)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    scale: float
    rope: RotaryEmbedding
    final_norm: torch.Tensor
    local_rope: RotaryEmbedding | None = None  # Gemma 3's sliding layers' own
    gelu: bool = False  # GELU (tanh) gating, not SiLU


class LlamaStack:
    """Runs a Llama model's decoder layers on a step, from their weights handed over
    as plain data (the model builds them; the stack knows nothing of its classes).
    Built only when every layer's linear layers have their blocks (``usable``).

    It remembers which KV caches it last wrote (rebinding when another engine's
    caches come in), so calls must not overlap: model work runs on the device
    runtime's one thread."""

    def __init__(
        self, layers: Sequence[LayerWeights], shape: StackShape, int8_dots: bool = False
    ) -> None:
        self._function = _function()
        self._layers = (_Layer * len(layers))()
        self._weights = tuple(layers)  # holds the tensors the C side points into
        for slot, layer in zip(self._layers, layers, strict=True):
            _check_layer(layer, shape)
            slot.input_norm = layer.input_norm.data_ptr()
            slot.post_norm = layer.post_norm.data_ptr()
            slot.q_norm = _pointer(layer.q_norm)
            slot.k_norm = _pointer(layer.k_norm)
            slot.attn_out_norm = _pointer(layer.attn_out_norm)
            slot.mlp_out_norm = _pointer(layer.mlp_out_norm)
            slot.window = layer.window or 0
            slot.local_rope = layer.local_rope
            slot.qkv = _matrix(layer.qkv, int8_dots)
            slot.o = _matrix(layer.o, int8_dots)
            slot.gate_up = _matrix(layer.gate_up, int8_dots)
            slot.down = _matrix(layer.down, int8_dots)
        self._dims = _Dims(
            shape.hidden_size,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.intermediate_size,
            0,
            shape.norm_eps,
            shape.scale,
            int8_dots,
            shape.gelu,
            0,
        )
        self._caches: Sequence[torch.Tensor] | None = None
        # The fewest blocks a cache holds among every layer, among the layers without
        # a window and among those with one (a hybrid model's windowed pool): what a
        # step's tables are checked against (``_bind``).
        self._least_blocks = (0, 0, 0)
        self._rope = shape.rope
        self._local_rope = shape.local_rope if any(w.local_rope for w in layers) else None
        check_tensors(final_norm=(shape.final_norm, torch.float32))
        check_shape("final_norm", shape.final_norm, shape.hidden_size)
        self._final_norm = shape.final_norm

    @staticmethod
    def usable(layers: Sequence[LayerWeights]) -> bool:
        """Whether every layer's linear layers have their blocks."""
        return all(linear.has_blocks for layer in layers for linear in layer.linears)

    @staticmethod
    def applies(x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a step with hidden states ``x`` and ``meta`` can run fused: its
        attention native, its rows float32."""
        return meta.native is not None and x.dtype == torch.float32

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final norm of the residual stream after every decoder layer (``x`` is
        updated in place and returned). Every tensor is checked here, every index it
        holds in C before the first is followed (no torch call: after the weights'
        stream each costs 10-30x its warm time): ValueError naming the one outside
        what it indexes."""
        native = meta.native
        assert native is not None
        if caches is not self._caches:
            self._bind(caches)
        every, unwindowed, windowed_pool = self._least_blocks
        windowed = meta.windowed.native if meta.windowed is not None else None
        self._check(x, positions, meta.slot_mapping, native)
        cos, sin, rope_rows = self._tables(self._rope)
        local = self._tables(self._local_rope) if self._local_rope else (None, None, 0)
        step = _Step(
            positions=positions.data_ptr(),
            cos=cos,
            sin=sin,
            rope_rows=rope_rows,
            local_cos=local[0],
            local_sin=local[1],
            local_rope_rows=local[2],
            slots=meta.slot_mapping.data_ptr(),
            block_tables=native.block_tables.data_ptr(),
            num_seqs=native.block_tables.shape[0],
            max_blocks=native.block_tables.shape[1],
            num_blocks=every if windowed is None else unwindowed,
            row_seqs=native.row_seqs.data_ptr(),
            context_lens=native.context_lens.data_ptr(),
        )
        if windowed is not None:
            assert meta.windowed is not None
            # The C side reads the step's rows against the windowed tables.
            window_slots, window_tables = meta.windowed.slot_mapping, windowed.block_tables
            rows = dataclasses.replace(native, block_tables=window_tables)
            self._check(x, positions, window_slots, rows)
            if window_tables.shape[0] != step.num_seqs:
                raise ValueError("the windowed block_tables are not one a sequence")
            step.window_slots, step.window_block_tables = (
                window_slots.data_ptr(),
                window_tables.data_ptr(),
            )
            step.window_max_blocks, step.window_num_blocks = window_tables.shape[1], windowed_pool
        failed = self._function(
            ctypes.addressof(self._layers),
            len(self._layers),
            ctypes.addressof(self._dims),
            x.data_ptr(),
            x.shape[0],
            ctypes.addressof(step),
            self._final_norm.data_ptr(),
            torch.get_num_threads(),
        )
        if failed == 1:
            raise MemoryError("the fused step could not allocate its buffers")
        if failed:
            raise ValueError(f"{_BAD_INDEX.get(failed, failed)} holds an index outside its range")
        return x

    def _tables(self, rope: RotaryEmbedding) -> tuple[int | None, int | None, int]:
        """A rotary embedding's cos and sin tables for the C side, and their rows."""
        cos, sin = rope.cos_table, rope.sin_table
        check_tensors(cos=(cos, torch.float32), sin=(sin, torch.float32))
        check_shape("cos", cos, cos.shape[0], self._dims.head_dim // 2)
        check_shape("sin", sin, cos.shape[0], self._dims.head_dim // 2)
        return cos.data_ptr(), sin.data_ptr(), cos.shape[0]

    def _check(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        native: NativeDecode,
    ) -> None:
        """Raise ValueError unless every tensor is what the C side reads (its indices
        it checks itself)."""
        block_tables, row_seqs, context_lens = (
            native.block_tables,
            native.row_seqs,
            native.context_lens,
        )
        check_tensors(
            x=(x, torch.float32),
            positions=(positions, torch.int64),
            slots=(slots, torch.int64),
            block_tables=(block_tables, torch.int64),
            row_seqs=(row_seqs, torch.int64),
            context_lens=(context_lens, torch.int64),
        )
        rows = x.shape[0]
        check_shape("x", x, rows, self._dims.hidden)
        check_shape("positions", positions, rows)
        check_shape("slots", slots, rows)
        check_shape("row_seqs", row_seqs, rows)
        check_shape("context_lens", context_lens, rows)
        if block_tables.dim() != 2:
            raise ValueError(f"block_tables has shape {tuple(block_tables.shape)}, expected 2-D")

    def _bind(self, caches: Sequence[torch.Tensor]) -> None:
        """Point every layer at its cache ([2, blocks, block_size, kv_heads, head_dim];
        a hybrid model's windowed layers' hold blocks of their own pool)."""
        cfg = self._dims
        shape = tuple(caches[0].shape)
        if len(shape) != 5 or shape[0] != 2 or shape[3:] != (cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(f"a KV cache of shape {shape} does not fit this model")
        blocks: list[int] = []
        dtype = caches[0].dtype
        if dtype not in NATIVE_KV_DTYPES:
            raise ValueError(f"a KV cache of {dtype}: the fused stack reads float32 or float16")
        for slot, cache in zip(self._layers, caches, strict=True):
            check_tensors(cache=(cache, dtype))
            check_shape("cache", cache, 2, cache.shape[1], *shape[2:])
            slot.k_cache = cache[0].data_ptr()
            slot.v_cache = cache[1].data_ptr()
            blocks.append(cache.shape[1])
        self._dims.block_size = shape[2]
        self._dims.kv_half = int(dtype == torch.float16)
        windows = [layer.window > 0 for layer in self._layers]
        self._least_blocks = (
            min(blocks),
            min((b for b, w in zip(blocks, windows, strict=True) if not w), default=0),
            min((b for b, w in zip(blocks, windows, strict=True) if w), default=0),
        )
        self._caches = caches
