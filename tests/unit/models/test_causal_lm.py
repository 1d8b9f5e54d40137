"""Our decoder model code reproduces transformers' greedy output token for token:
tiny random models of every supported architecture, and the built-in model, alone
and batched, on the CPU and on a CUDA device where there is one (there the native
kernels do not apply: the torch path runs). GGUF tensors are read back into the
right places."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from carpool.config import EngineConfig
from carpool.engine.block_manager import HybridBlockManager
from carpool.engine.sampling_params import SamplingParams
from carpool.models import causal_lm, gguf_file
from carpool.models.causal_lm import LoadedLM, convert_gguf, load_causal_lm
from carpool.models.gguf_file import GGUFCheckpoint
from carpool.models.registry import BUILTIN_MODELS
from carpool.workers.factory import engine_for
from carpool.workers.model_runner import ModelRunner
from tests import tiny_models

GREEDY = dict(temperature=0.0, ignore_eos=True)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def generate(
    lm: LoadedLM,
    prompts: list[list[int]],
    max_tokens: int,
    num_blocks: int | None = None,
    **engine: Any,
) -> list[list[int]]:
    """Every prompt in one engine run; the generated token ids of each."""
    config = EngineConfig(**{"kv_cache_memory": "256MiB", **engine})
    eng = engine_for(lm, config, num_blocks=num_blocks)
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))  # type: ignore[arg-type]
    done: dict[str, list[int]] = {}
    while eng.has_work:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", tiny_models.ARCHITECTURES)
def test_tiny_model_matches_transformers_alone_and_batched(
    arch: str, device: str, tmp_path: Path, smollm_folder: Path
) -> None:
    reference = tiny_models.build(arch, tmp_path, smollm_folder).to(device)
    lm = load_causal_lm(tmp_path, progress=False, device=device)
    assert lm.device.type == device
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in (1, 7, 40, 300)]
    expected = [tiny_models.hf_greedy(reference, p, 20) for p in prompts]
    for prompt, want in zip(prompts, expected, strict=True):
        assert generate(lm, [prompt], 20) == [want]
    # Batched, with a small step budget: the long prompt is prefilled in chunks
    # while the others decode.
    assert generate(lm, prompts, 20, max_num_batched_tokens=64) == expected


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "qwen3"])
def test_sliding_windows_match_transformers_past_the_window(
    arch: str, tmp_path: Path, smollm_folder: Path
) -> None:
    """A window of 16 (Mistral: every layer; Gemma 3: its sliding layer beside a
    global one; Qwen3: its second layer, by ``max_window_layers``) under prompts and
    outputs well past it: alone, then batched with prompts prefilled in chunks that
    start past the window, on the native decode kernel and on torch's grouped path;
    then a prompt whose first 80 tokens come from the prefix cache. Blocks behind the
    window are released: Mistral's sequences also run on a cache of 5 blocks (80
    tokens), shorter than each, and Gemma 3's and Qwen3's on a pool of 12 for their
    windowed layer, shorter than the longest."""
    reference = tiny_models.build(arch, tmp_path, smollm_folder, sliding_window=16)
    lm = load_causal_lm(tmp_path, progress=False)
    assert set(lm.config.layer_windows()) >= {16}
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in (5, 23, 90)]
    expected = [tiny_models.hf_greedy(reference, p, 24) for p in prompts]
    assert [generate(lm, [p], 24)[0] for p in prompts] == expected
    for kernel in ("native", "torch"):
        got = generate(lm, prompts, 24, max_num_batched_tokens=32, attention_kernel=kernel)
        assert got == expected, kernel
    shared = [*prompts[2][:80], 7, 8, 9]
    engine = engine_for(lm, EngineConfig(kv_cache_memory="64MiB", max_num_batched_tokens=32))
    done: dict[str, list[int]] = {}
    for i, prompt in enumerate([prompts[2], shared]):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, **GREEDY))  # type: ignore[arg-type]
        while engine.has_work:
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert engine.blocks.stats.hits > 0
    assert done["1"] == tiny_models.hf_greedy(reference, shared, 24)
    longer = [[*p, *p] for p in prompts]  # 10, 46, 180 tokens + 24
    want = [tiny_models.hf_greedy(reference, p, 24) for p in longer]
    if arch == "mistral":
        for kernel in ("native", "torch"):
            got = generate(lm, longer, 24, 6, max_num_batched_tokens=32, attention_kernel=kernel)
            assert got == want, kernel
    else:
        # The sliding layer's KV has a pool of its own, freed behind the window: for
        # three sequences at most, 12 blocks (11 beside the null one: 176 tokens),
        # shorter than the longest sequence; the global layer's pool takes the rest.
        assert isinstance(engine.blocks, HybridBlockManager)
        pools = ModelRunner.pools_for_memory(lm, 256 << 20, 16, 3, 32)
        assert pools[1] == 12 and (pools[1] - 1) * 16 < 180 + 24
        # 64 windows want more than one shared pool would give: it gets that much.
        shared = ModelRunner.blocks_for_memory(lm, 1 << 20, 16)
        assert ModelRunner.pools_for_memory(lm, 1 << 20, 16, 64, 32) == (shared, shared)
        for kernel in ("native", "torch"):
            config = {"max_num_batched_tokens": 32, "max_num_seqs": 3, "attention_kernel": kernel}
            assert generate(lm, longer, 24, **config) == want, kernel


def test_gguf_tensors_land_in_place_for_each_type(tmp_path: Path, smollm_folder: Path) -> None:
    reference = tiny_models.build("llama", tmp_path / "hf", smollm_folder)
    cfg = reference.config
    path = tmp_path / "tiny.gguf"
    writer = gguf_writer(path, "llama", cfg)
    kinds = [
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_1,
    ]
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    parts = {v: k for k, v in gguf_file._LAYER_NAMES.items()}
    originals: dict[str, torch.Tensor] = {}
    written: dict[str, gguf.GGMLQuantizationType] = {}
    for i, (name, tensor) in enumerate(reference.state_dict().items()):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        data = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        if name in names:
            gguf_name = names[name]
        else:
            _, _, layer, *middle, kind = name.split(".")
            gguf_name = f"blk.{layer}.{parts['.'.join(middle)]}.{kind}"
        kind_ = kinds[i % len(kinds)] if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(gguf_name, quantize(data, kind_), raw_dtype=kind_)
        originals[name] = tensor
        written[name] = kind_
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.hf_config()["num_key_value_heads"] == cfg.num_key_value_heads
    loaded = dict(checkpoint.tensors(progress=False))
    assert set(loaded) == set(originals)
    tolerance = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q4_0": 0.2, "Q4_1": 0.2}
    seen = set()
    for name, original in originals.items():
        kind = written[name].name
        seen.add(kind)
        error = (loaded[name] - original).abs().max() / original.abs().max()
        assert error <= tolerance[kind], f"{name} ({kind}) off by {error}"
    assert seen == set(tolerance)


def gguf_writer(
    path: Path, arch: str, cfg: Any, rope_theta: float | None = None
) -> gguf.GGUFWriter:
    """A GGUF writer for ``arch`` with the metadata of the transformers config ``cfg``;
    ``rope_theta``: the rotary base to write where the config has one per layer kind."""
    if rope_theta is None:
        rope_theta = cfg.rope_parameters.get("rope_theta", 10000.0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    return writer


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script's permutation of Q/K rows."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def test_a_converted_gguf_is_reused_not_converted_again(
    carpool_cache: Path, smollm_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("converted a second time")

    monkeypatch.setattr(causal_lm, "GGUFCheckpoint", refuse)
    path = BUILTIN_MODELS["smollm2-135m-instruct"].locate()
    assert convert_gguf(path, carpool_cache, progress=False) == smollm_folder


# Eight chat prompts of different kinds (the suite's time: transformers takes ~3 s a
# prompt here; more of the same shapes added no path).
BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "def fibonacci(n):",
    "What is 12 times 7?",
    "Summarise the plot of Romeo and Juliet.",
    "Héllo 🚗! Répondez en français, s'il vous plaît.",
    "How do I reverse a list in Python?",
    "The quick brown fox",
]


def load_hf_builtin() -> Any:
    """transformers' own load of the built-in GGUF (dequantized to float32)."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    path = BUILTIN_MODELS["smollm2-135m-instruct"].locate()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()


@pytest.fixture(scope="module")
def hf_builtin() -> Any:
    return load_hf_builtin()


def builtin_prompts(tok: Any) -> list[list[int]]:
    """The 8 chat prompts above, templated, and three long ones (600 characters,
    1,000 and 1,600 tokens: four chunks of 512)."""
    chats = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for p in BUILTIN_PROMPTS
    ]
    story = "The history of the city goes back many centuries. " * 40
    long_prompts = [
        tok.encode(story[:600]),
        tok.encode(story * 2)[:1000],
        tok.encode(story * 10)[:1600],
    ]
    return [list(p) for p in chats] + long_prompts


def assert_matches_on_11_prompts(lm: LoadedLM, reference: Any) -> None:
    prompts = builtin_prompts(lm.tokenizer)
    assert len(prompts) == 11 and max(len(p) for p in prompts) == 1600
    expected = [tiny_models.hf_greedy(reference, p, 16) for p in prompts]
    got = generate(lm, prompts, 16, max_num_batched_tokens=512)
    mismatches = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert not mismatches, f"prompts {mismatches} differ from transformers on {lm.device}"


@pytest.mark.slow
def test_builtin_model_matches_transformers_on_11_prompts(
    smollm: LoadedLM, hf_builtin: Any
) -> None:
    assert_matches_on_11_prompts(smollm, hf_builtin)


@CUDA
def test_builtin_model_matches_transformers_on_11_prompts_on_cuda(smollm_folder: Path) -> None:
    lm = load_causal_lm(smollm_folder, progress=False, device="cuda")
    assert lm.device.type == "cuda"
    assert_matches_on_11_prompts(lm, load_hf_builtin().to("cuda"))


def test_a_qwen3_gguf_reads_back_its_config_and_q_k_norms(
    tmp_path: Path, smollm_folder: Path
) -> None:
    """llama.cpp writes Qwen3's head size as ``key_length`` (not hidden / heads) and
    its q/k norms as ``attn_q_norm``/``attn_k_norm``; Qwen's Q/K rows are not permuted."""
    reference = tiny_models.build("qwen3", tmp_path / "hf", smollm_folder)
    cfg = reference.config
    path = tmp_path / "tiny-qwen3.gguf"
    writer = gguf_writer(path, "qwen3", cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    parts = {v: k for k, v in gguf_file._LAYER_NAMES.items()}
    originals = {}
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight"}.get(
                name, "output_norm.weight"
            )
        else:
            _, _, layer, *middle, kind = name.split(".")
            gguf_name = f"blk.{layer}.{parts['.'.join(middle)]}.{kind}"
        writer.add_tensor(gguf_name, tensor.numpy().astype(np.float32))
        originals[name] = tensor
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.hf_config()
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32
    assert config["tie_word_embeddings"]
    loaded = dict(checkpoint.tensors(progress=False))
    assert set(loaded) == set(originals)
    assert any(name.endswith("self_attn.q_norm.weight") for name in loaded)
    for name, original in originals.items():
        assert torch.equal(loaded[name], original), name


def test_an_unsupported_architecture_is_refused_listing_the_supported_ones(
    tmp_path: Path,
) -> None:
    from carpool.errors import ModelNotFound
    from carpool.models.registry import resolve

    (tmp_path / "config.json").write_text('{"architectures": ["FalconForCausalLM"]}')
    with pytest.raises(ModelNotFound) as caught:
        resolve(str(tmp_path))
    assert "FalconForCausalLM" in caught.value.message
    assert "Qwen3ForCausalLM" in caught.value.message and "BertModel" in caught.value.message


def test_a_generic_tokenizer_loads_as_auto_tokenizer_loads_it(smollm_folder: Path) -> None:
    """The built-in's tokenizer names the generic class: loaded without
    AutoTokenizer, it is the same tokenizer (class, vocabulary, special tokens,
    encodings and chat template)."""
    from transformers import AutoTokenizer

    from carpool.models.causal_lm import load_tokenizer

    ours, auto = load_tokenizer(smollm_folder), AutoTokenizer.from_pretrained(str(smollm_folder))
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and ours.all_special_ids == auto.all_special_ids
    assert (ours.eos_token_id, ours.bos_token_id) == (auto.eos_token_id, auto.bos_token_id)
    text = "Héllo 🚗 <|im_start|>user\n  spaced\ttabs"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
