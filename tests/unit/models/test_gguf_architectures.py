"""Phi-3 and Gemma 3 GGUF files, written here as llama.cpp's converter writes them
(``conversion/phi.py``, ``conversion/gemma.py``): Phi-3's q/k/v fused in
``attn_qkv`` and gate/up in ``ffn_up``, its LongRoPE factors as tensors; Gemma 3's
norms stored as 1 + weight, its layer kinds as a pattern, its query scale and the
sliding layers' rotary base left to the reader. Each gives its transformers model's
greedy tokens, on float32 tensors and on Q8_0 blocks (on the fused stack)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from carpool.models.causal_lm import load_causal_lm
from carpool.models.gguf_file import GGUFCheckpoint
from carpool.models.llama import LlamaForCausalLM
from tests import tiny_models
from tests.unit.models.test_causal_lm import generate, gguf_writer
from tests.unit.models.test_gguf_blocks import lay_out_converted

PHI3 = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA3 = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
WINDOW = 16


def reference_model(arch: str, folder: Path, smollm_folder: Path) -> Any:
    if arch == "gemma3":
        # What a GGUF can say: the query scale is the head size (llama.cpp's rule
        # below 27B), layer kinds a pattern, a window short enough to matter.
        return tiny_models.build(
            arch, folder, smollm_folder, sliding_window=WINDOW, query_pre_attn_scalar=32
        )
    return tiny_models.build(arch, folder, smollm_folder)


def metadata(writer: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    """What llama.cpp's converter writes for ``arch`` beyond ``gguf_writer``'s."""
    writer.add_eos_token_id(2)
    rope = cfg.rope_parameters
    if arch == "phi3":
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(0)  # none: the tiny model has no window
    else:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([k == "sliding_attention" for k in cfg.layer_types])
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)


def write_gguf(reference: Any, arch: str, path: Path, blocks: bool) -> None:
    """The model as llama.cpp's converter writes it; with ``blocks`` its matrices
    as Q8_0, the reference given the values those blocks hold."""
    cfg = reference.config
    rope = cfg.rope_parameters
    # Gemma 3's rotary base in the file is its global layers'.
    theta = rope["full_attention"]["rope_theta"] if arch == "gemma3" else None
    writer = gguf_writer(path, arch, cfg, rope_theta=theta)
    metadata(writer, arch, cfg)
    layer_names = PHI3 if arch == "phi3" else GEMMA3
    state = reference.state_dict()
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in GLOBAL:
            gguf_name = GLOBAL[name]
        else:
            _, _, layer, *middle, kind = name.split(".")
            gguf_name = f"blk.{layer}.{layer_names['.'.join(middle)]}.{kind}"
        data = tensor.numpy().astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # Gemma3RMSNorm's 1 + weight, stored
            kept[name] = torch.from_numpy(data - np.float32(1.0))
        if blocks and data.ndim == 2:
            raw = quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            held = dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
            kept[name] = torch.from_numpy(np.array(held, dtype=np.float32))
        else:
            writer.add_tensor(gguf_name, data)
    if arch == "phi3":
        for which in ("long", "short"):
            factors = np.array(cfg.rope_parameters[f"{which}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{which}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference.load_state_dict({**state, **kept})


@pytest.mark.parametrize("blocks", [False, True], ids=["float32", "q8_0"])
@pytest.mark.parametrize("arch", ["phi3", "gemma3"])
def test_a_gguf_gives_its_transformers_models_tokens(
    arch: str, blocks: bool, tmp_path: Path, smollm_folder: Path
) -> None:
    reference = reference_model(arch, tmp_path / "hf", smollm_folder)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(reference, arch, path, blocks)
    config = GGUFCheckpoint(path).hf_config()
    assert config["architectures"] == [type(reference).__name__]
    if arch == "gemma3":
        assert config["layer_types"] == ["sliding_attention", "full_attention"]
        assert (config["query_pre_attn_scalar"], config["rope_local_base_freq"]) == (32, 10000.0)
    else:
        assert config["rope_scaling"]["rope_type"] == "longrope"
    lm = load_causal_lm(lay_out_converted(path, tmp_path / "converted", smollm_folder))
    model = lm.model
    assert isinstance(model, LlamaForCausalLM)
    # On blocks, steps run on the fused stack (Phi-3's split q/k/v and gate/up fused
    # again; Gemma 3's norms, GELU and two rotary tables).
    assert (model.stack is not None) == blocks, model.stack_unused_because
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, tiny_models.VOCAB, n)] for n in (5, 23, 40)]
    expected = [tiny_models.hf_greedy(reference, p, 16) for p in prompts]
    assert generate(lm, prompts, 16, max_num_batched_tokens=32) == expected


@pytest.mark.parametrize(("layers", "scalar"), [(12, 256), (62, 168)])
def test_gemma3_hyperparameters_a_gguf_leaves_out_are_llama_cpps(
    layers: int, scalar: int, tmp_path: Path
) -> None:
    """No pattern in the file: every sixth layer is global; the query scale is the
    head size, or hidden / heads on the 62-layer (27B) model, as llama.cpp reads it;
    <end_of_turn> ends generation beside <eos>."""
    path = tmp_path / "gemma3.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(layers)
    writer.add_embedding_length(5376)
    writer.add_feed_forward_length(128)
    writer.add_head_count(32)
    writer.add_head_count_kv(16)
    writer.add_key_length(256)
    writer.add_sliding_window(1024)
    writer.add_vocab_size(8)
    writer.add_token_list(
        ["<pad>", "<eos>", "<bos>", "a", "b", "<start_of_turn>", "<end_of_turn>", "c"]
    )
    writer.add_eos_token_id(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = GGUFCheckpoint(path).hf_config()
    kinds = config["layer_types"]
    assert [i for i, k in enumerate(kinds) if k == "full_attention"] == list(range(5, layers, 6))
    assert config["query_pre_attn_scalar"] == scalar and config["sliding_window"] == 1024
    assert config["tie_word_embeddings"]
    assert config["eos_token_id"] == [1, 6], "a chat turn's end ends generation too"
