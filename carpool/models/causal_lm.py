"""Loading a text-generation model: our model code, its weights and its tokenizer.

From a Hugging Face folder (config.json, safetensors, tokenizer files) or a GGUF
file. A GGUF file is converted once into a Hugging Face folder under the cache
directory (float weights in safetensors, the tokenizer and chat template saved
by ``transformers``), so the second load reads that folder and is fast.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file
from torch import nn

from carpool import c_heap, huge_pages
from carpool.config import ConfigError, default_cache_dir
from carpool.models.attention import AttentionMetadata
from carpool.models.decoder_config import GEMMA3_FAMILY, GPT2_FAMILY, LLAMA_FAMILY, DecoderConfig
from carpool.models.gemma3 import Gemma3ForCausalLM
from carpool.models.generation_defaults import read_generation_defaults
from carpool.models.gguf_file import GGUFCheckpoint
from carpool.models.gpt2 import GPT2LMHeadModel
from carpool.models.llama import LlamaForCausalLM
from carpool.models.native import KernelUnavailable, torch_because
from carpool.models.packed_linear import (
    BlocksFile,
    Linear,
    PackedWeight,
    QuantizedLinearKernel,
    quantized_linear_kernel,
    save_packed,
)
from carpool.models.weights import iter_safetensors, read_json
from carpool.paths import PathTaken

log = logging.getLogger(__name__)

# Bump when the converted folder's layout or contents change (2: Q4_1 and Q8_0 blocks
# kept, PACKED; 3: the K-quants, blocks only; 4: the Q5_1 layout; 5: the Q5_0 layout;
# 6: Q4_K's and Q5_K's own scales beside their blocks; 7: Q6_K's; 8: those in the
# files' bits, d and dmin float16, Q4_K's and Q5_K's sc and m 6 bits each).
_CONVERSION_VERSION = "8"
# In a subfolder: every *.safetensors of the folder itself is a model weight file.
PACKED = Path("blocks") / "gguf-blocks.safetensors"


class CausalLM(Protocol):
    config: DecoderConfig

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


# The families' architecture names are listed once, in ``decoder_config``.
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    **dict.fromkeys(LLAMA_FAMILY, LlamaForCausalLM),
    **dict.fromkeys(GEMMA3_FAMILY, Gemma3ForCausalLM),
    **dict.fromkeys(GPT2_FAMILY, GPT2LMHeadModel),
}


@dataclass
class LoadedLM:
    """A ready model with what serving it needs."""

    name: str
    model: CausalLM
    config: DecoderConfig
    tokenizer: Any  # a transformers PreTrainedTokenizerFast
    folder: Path
    dtype: torch.dtype
    device: torch.device
    packed_layers: int = 0  # linear layers that run few rows on the file's blocks
    paths: tuple[PathTaken, ...] = ()  # which code runs each part (native or torch)
    # Sampling defaults from generation_config.json, for fields a request leaves unset.
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return _eos_token_ids(self.config, self.tokenizer)

    def facts(self) -> ModelFacts:
        """What serving this model needs besides its weights."""
        return ModelFacts(self.name, self.config, self.tokenizer, self.generation_defaults)


@dataclass(frozen=True)
class ModelFacts:
    """A loaded model's tokenizer, config and sampling defaults without its weights:
    what a server needs of a model that runs in an engine process (they pickle)."""

    name: str
    config: DecoderConfig
    tokenizer: Any
    generation_defaults: dict[str, Any]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return _eos_token_ids(self.config, self.tokenizer)


def _eos_token_ids(config: DecoderConfig, tokenizer: Any) -> frozenset[int]:
    ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def load_causal_lm(
    path: Path,
    name: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
    progress: bool = True,
    weight_kernel: str = "auto",
) -> LoadedLM:
    """Load ``path`` (a folder or a .gguf file) onto ``device``. ``weight_kernel``
    (auto, native, native-int8 or torch): whether linear layers run on a GGUF file's
    blocks (``carpool.models.packed_linear``), keeping no float32 copy of those
    weights, and with native-int8 use integer dot products there."""
    folder = path
    if path.suffix == ".gguf":
        folder = convert_gguf(path, cache_dir or default_cache_dir(), progress)
    config = DecoderConfig.from_hf(read_json(folder / "config.json"))
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    blocks = _blocks_for(model, folder, weight_kernel, device, dtype)
    held: set[str] = set()
    if blocks.packed is not None:  # the blocks alone hold those weights
        held = model.drop_float_where_blocks(blocks.packed)  # type: ignore[operator]
    model = _materialize(model, device)
    _reset_buffers(model, config, device)
    weights = _weights(folder, blocks.packed, held)
    if held:
        model.load_weights(weights, blocks_hold=held)  # type: ignore[operator]
    else:
        model.load_weights(weights)  # type: ignore[operator]
    model = model.to(dtype).eval().requires_grad_(False)
    packed_layers, linear = _attach_packed(model, blocks, weight_kernel)
    tokenizer = load_tokenizer(folder)
    c_heap.trim()  # what loading's temporaries freed, before a KV cache is allocated
    huge_pages.collapse(_weight_tensors(model), torch.get_num_threads())
    return LoadedLM(
        name=name or path.stem,
        model=model,  # type: ignore[arg-type]
        config=config,
        tokenizer=tokenizer,
        folder=folder,
        dtype=dtype,
        device=torch.device(device),
        packed_layers=packed_layers,
        paths=(linear, *_stack_path(model, packed_layers)),
        generation_defaults=read_generation_defaults(folder),
    )


def _weight_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """The tensors a step streams the weights from: parameters, buffers and every
    linear layer's blocks."""
    for module in model.modules():
        yield from module.parameters(recurse=False)
        yield from module.buffers(recurse=False)
        if isinstance(module, Linear):
            yield from module.block_tensors()


def _stack_path(model: nn.Module, packed_layers: int) -> tuple[PathTaken, ...]:
    """The fused decoder stack's path, for a model whose layers have their blocks."""
    if not packed_layers or not hasattr(model, "stack"):
        return ()
    if model.stack is not None:
        return (PathTaken("decoder stack", True, "llama_stack, one call per step"),)
    return (PathTaken("decoder stack", False, model.stack_unused_because),)


def _weights(
    folder: Path, packed: Mapping[str, PackedWeight] | None, held: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's float tensors, then the float32 of every block matrix the model
    does not run on its blocks (a GGUF conversion keeps those as blocks only),
    none of those named in ``held``; one tensor at a time. ``packed``: the blocks
    (a ``BlocksFile``, or a conversion's own) where the caller has them."""
    yield from iter_safetensors(folder, held)
    if packed is None and (folder / PACKED).exists():
        packed = BlocksFile(folder / PACKED)
    for name in list(packed or {}):
        if packed is not None and name not in held:  # a BlocksFile reads it only then
            yield name, packed[name].dequantize()


@dataclass(frozen=True)
class _Blocks:
    """A GGUF conversion's blocks and the kernel to run them, or why not."""

    packed: MutableMapping[str, PackedWeight] | None  # a BlocksFile: read as taken
    kernel: QuantizedLinearKernel | None
    why: str = ""
    unavailable: bool = False  # no compiler (as opposed to a setting)


def _blocks_for(
    model: nn.Module, folder: Path, choice: str, device: str, dtype: torch.dtype
) -> _Blocks:
    """The blocks a GGUF file's conversion kept (``PACKED``), where ``choice``
    (auto, native, native-int8, torch) and the model let them run."""
    if choice == "torch":
        return _Blocks(None, None, "weight_kernel is torch")
    if not (folder / PACKED).exists():
        why = "the model has no quantized blocks (it is not a GGUF file holding them)"
    elif torch.device(device).type != "cpu":
        why = f"the kernel runs on the CPU and the model is on {device}"
    elif dtype != torch.float32:
        why = f"the kernel takes float32 and the model is {dtype}"
    elif not hasattr(model, "attach_packed"):
        why = f"{type(model).__name__} has no packed layers"
    else:
        blocks = BlocksFile(folder / PACKED)
        try:
            kernel = quantized_linear_kernel(int8_dots=_int8_dots(choice, blocks))
        except KernelUnavailable as exc:
            return _Blocks(None, None, str(exc), True)
        return _Blocks(blocks, kernel)
    return _Blocks(None, None, why)


def _int8_dots(choice: str, blocks: BlocksFile) -> bool:
    """Whether the linear layers use int8 dot products: with native-int8, and with
    auto for a K-quant file (Q4_K_M, Q5_K_M, Q6_K: a quality its maker, llama.cpp,
    measures with each layer's input rounded to int8) where the interleaved kernel
    has its vector code (AVX2 or AVX-512 VNNI); other files run exact (native)."""
    if choice == "native-int8":
        return True
    if choice != "auto" or not blocks.has_k_quants:
        return False
    return quantized_linear_kernel(int8_dots=True).interleaved_vectorized > 0


def _attach_packed(model: nn.Module, blocks: _Blocks, choice: str) -> tuple[int, PathTaken]:
    """Attach ``blocks``; the number of linear layers that got them and the path
    taken. ``native`` and ``native-int8`` raise ValueError where they cannot be
    used; ``auto`` logs why not."""
    part = "linear layers"
    if choice == "torch":
        return 0, PathTaken(part, False, blocks.why)
    why = blocks.why
    if blocks.packed is not None and blocks.kernel is not None:
        kernel = blocks.kernel
        count: int = model.attach_packed(blocks.packed, kernel)  # type: ignore[operator]
        if count:
            detail = f"quantized_linear on the file's blocks, {count} layers, no float32 copy"
            if kernel.int8_dots and kernel.interleaved_vectorized:
                detail += f", int8 dot products on interleaved blocks ({kernel.int8_code})"
                if choice == "auto":
                    detail += " (auto: a K-quant file, run as llama.cpp runs it)"
            elif kernel.int8_dots:
                detail += ", int8 dot products for up to 8 rows (no AVX2 here)"
            log.info("%d linear layers run on the file's blocks", count)
            return count, PathTaken(part, True, detail)
        why = "no linear layer has all its weights in blocks of a native layout"
    if choice != "auto":
        raise ValueError(f"weight_kernel {choice} cannot be used: {why}")
    return 0, torch_because(part, why, blocks.unavailable)


def _materialize(model: nn.Module, device: str) -> nn.Module:
    """``model.to_empty(device=device)`` without torch's reference ops: its
    ``empty_like`` of a meta tensor imports sympy (~35 MiB, 0.3 s) to lay out
    nothing."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def _reset_buffers(model: nn.Module, config: DecoderConfig, device: str) -> None:
    """Non-persistent buffers (rotary tables) are not in checkpoints: rebuild them."""
    from carpool.models.rope import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset(device)


# Tokenizer classes AutoTokenizer resolves to the generic one (transformers 5's
# TokenizersBackend, also named PreTrainedTokenizerFast).
_GENERIC_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer, as ``AutoTokenizer`` loads it. Where its
    ``tokenizer_config.json`` names the generic class, that class loads it directly:
    ``AutoTokenizer`` would read ``config.json`` through transformers' configuration
    classes, whose imports (torch.distributed, sympy) cost ~57 MiB of memory and a
    second here, for the same tokenizer."""
    config = folder / "tokenizer_config.json"
    named = json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
    if named in _GENERIC_TOKENIZERS and (folder / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def save_converted(path: Path, folder: Path, progress: bool = True) -> dict[str, Any]:
    """Write the GGUF file ``path``'s weights and ``config.json`` into ``folder`` (an
    existing one) as carpool loads them, its tokenizer left to the caller; returns
    the config. The blocks are kept as they are; only the other tensors (norms, float
    matrices, types without a native layout) are dequantized."""
    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.hf_config()
    packed = checkpoint.packed_weights()
    if packed:
        save_packed(packed, folder / PACKED)
    tensors = dict(checkpoint.tensors(progress, skip=set(packed)))
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return config


def convert_gguf(path: Path, cache_dir: Path, progress: bool = True) -> Path:
    """The Hugging Face folder converted from ``path``, made on first use."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{_CONVERSION_VERSION}"
    target = (
        cache_dir / "converted" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    )
    if (target / "model.safetensors").exists():
        return target
    log.info("converting %s into %s (once)", path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        save_converted(path, staging, progress)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(staging))
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise  # not another process winning the race: a real failure
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def customize_tokenizer(lm: LoadedLM, tokenizer: str = "", chat_template: str = "") -> None:
    """Give ``lm`` another tokenizer (``tokenizer``: a folder or a hub id) and/or
    another chat template (``chat_template``: a file's path or the template itself).
    Raises ``ConfigError`` for a tokenizer that is not there or whose vocabulary is
    larger than the model's, and for a template that does not parse."""
    if tokenizer:
        from transformers import AutoTokenizer

        from carpool.models.hub import hub_model, is_hub_id

        path = Path(tokenizer).expanduser()
        if not path.exists() and is_hub_id(tokenizer):
            path = hub_model(tokenizer)
        if not path.is_dir():
            raise ConfigError(f"tokenizer {tokenizer!r} is neither a folder nor a hub id")
        replacement = AutoTokenizer.from_pretrained(str(path))
        if len(replacement) > lm.config.vocab_size:
            raise ConfigError(
                f"tokenizer {tokenizer!r} has {len(replacement)} tokens; the model "
                f"{lm.name} has {lm.config.vocab_size}"
            )
        lm.tokenizer = replacement
    if chat_template:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        text = _file_text(chat_template)
        try:
            ImmutableSandboxedEnvironment().parse(text)
        except TemplateSyntaxError as exc:
            raise ConfigError(f"chat_template does not parse: {exc}") from None
        lm.tokenizer.chat_template = text


def _file_text(value: str) -> str:
    """The text of the file ``value`` names, else ``value`` itself."""
    try:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text()
    except OSError:  # a template is no file name (too long, say)
        pass
    return value
