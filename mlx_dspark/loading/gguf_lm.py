"""A plain causal LM's GGUF given as the draft (llama.cpp's `-md small.gguf`): `general.architecture` `llama`,
`qwen2` or `qwen3`, `token_embd` and `blk.N.attn_q` ... and none of a DSpark draft's keys, read as the Hugging
Face checkpoint it was converted from, so that the draft model head (loading/heads/draft_lm.py) runs it through
mlx-lm's class of its family.

What upstream's converter (convert_hf_to_gguf.py) changed is undone here: `llama`'s q / k rows were permuted per
head for llama.cpp's interleaved RoPE (`LlamaModel.permute`), so they are put back in the rotate-half order
mlx-lm's llama computes with (`unpermute_llama`); qwen2 and qwen3 are stored as they are (NeoX RoPE there too).
What such a file may hold beyond what we map (RoPE scaling, experts, partial rotary) is refused in one line
naming the key and the fix: the Hugging Face model itself as the draft.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlx_dspark.loading.gguf_layout import LAYER_COMMON, LAYER_QWEN3, size_fields, special_ids, target_layout
from mlx_dspark.loading.gguf_metadata import Metadata

LM_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FIX = "pass the model's Hugging Face id, or a folder mlx_lm.convert made from it, as --draft (draft= in Python)"
ATTENTION = {k: v for k, v in LAYER_QWEN3.items() if not k.endswith("_norm")}  # attn_q/k/v/output; qwen3 adds q/k norms


def lm_layout(meta: Metadata, arch: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(config, GGUF tensor name -> Hugging Face name) of a plain causal LM read as a draft model."""
    _refuse_what_we_do_not_map(meta, arch)
    if arch == "qwen3":
        return target_layout(meta, arch)  # the qwen3 target's reading: the same file
    p = f"{arch}."
    sizes = size_fields(meta, arch)
    dims = meta.integer(p + "rope.dimension_count", sizes["head_dim"], low=1)
    if dims != sizes["head_dim"]:
        _refuse(meta, arch, f"key {p + 'rope.dimension_count'!r} is {dims}, not the head size {sizes['head_dim']} (partial RoPE)")
    embed = meta.tensor_or_fail("token_embd.weight", "every language model has its token embedding")
    bias = arch == "qwen2" or "blk.0.attn_q.bias" in meta.tensors  # qwen2's q / k / v always have one
    config: dict[str, Any] = {
        "architectures": [LM_ARCHITECTURES[arch]],
        "model_type": arch,
        **sizes,
        "attention_bias": bias,
        "hidden_act": "silu",
        "rope_theta": meta.number(p + "rope.freq_base", 10000.0),  # llama.cpp's default
        "vocab_size": embed[0],
        "tie_word_embeddings": "output.weight" not in meta.tensors,
    }
    special_ids(meta, config)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names["output.weight"] = "lm_head.weight"
    for i in range(sizes["num_hidden_layers"]):
        for g, h in {**LAYER_COMMON, **ATTENTION}.items():
            names[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"
        if bias:
            names.update({f"blk.{i}.attn_{x}.bias": f"model.layers.{i}.self_attn.{x}_proj.bias" for x in "qkv"})
    return dict(sorted(config.items())), names


def unpermute_llama(weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """llama's q / k rows (a quantized weight's scales and biases, a bias: every tensor of the projection) back in
    the Hugging Face order, the inverse of upstream's `LlamaModel.permute` (the key heads' own count for k)."""
    for i in range(config["num_hidden_layers"]):
        for proj, heads in (("q_proj", config["num_attention_heads"]), ("k_proj", config["num_key_value_heads"])):
            prefix = f"model.layers.{i}.self_attn.{proj}."
            for name in [n for n in weights if n.startswith(prefix)]:
                rows = weights[name].shape[0]
                # the Hugging Face row (head, half, j) (rotate-half: pair j's two halves apart) is stored at (head, j, half)
                order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
                weights[name] = mx.take(weights[name], mx.array(order), axis=0)
    return weights


def _refuse(meta: Metadata, arch: str, what: str) -> None:
    raise ValueError(
        f"{meta.path}: a plain language model GGUF (architecture {arch!r}) given as the draft, read as a draft model, "
        f"but {what}, which we do not map; {FIX}"
    )


def _refuse_what_we_do_not_map(meta: Metadata, arch: str) -> None:
    p = f"{arch}."
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        _refuse(meta, arch, f"key {p + 'rope.scaling.type'!r} is {scaling!r} (RoPE scaling)")
    if "rope_freqs.weight" in meta.tensors:
        _refuse(meta, arch, "it holds tensor 'rope_freqs.weight' (Llama 3's RoPE scaling)")
    experts = meta.get(p + "expert_count")
    if experts:
        _refuse(meta, arch, f"key {p + 'expert_count'!r} is {experts} (a mixture of experts)")
