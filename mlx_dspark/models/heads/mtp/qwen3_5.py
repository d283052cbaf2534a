"""Qwen3.5 / 3.6 / 3.8's own multi-token-prediction layers (`mtp.*` in the Hugging Face checkpoint).

One MTP step (DRAFTERS.md section 2; vLLM `qwen3_next_mtp.py`, mlx-vlm `drafters/qwen3_5_mtp/`) reads
the target's final *normed* hidden state h_t at position t and the embedding of the token at t + 1:

    x = fc([pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)])   # (B, L, 2C) -> (B, L, C)
    x = layers.0(x)       # one full-attention decoder layer (gated q, partial RoPE) over its own KV cache
    h = norm(x)           # -> the target's lm_head gives token_{t+2}

Entry t of the MTP cache sits at RoPE position t. A chain of k > 1 steps feeds `h` (the MTP's own normed
output) back as the next step's hidden state, beside the embedding of the token it just proposed.
The embedding and the LM head are the target's (`embed`, `logits` take the target).

The layer is mlx-lm's own qwen3_5 `DecoderLayer` built with every layer full attention, so its numerics
are the target's attention layers'; attribute names are the checkpoint's names without `mtp.`. A Qwen3.5-MoE
target's (`qwen3_5_moe`) MTP layer has the target's sparse MoE MLP (`num_experts` > 0), its experts stacked
into mlx-lm's `switch_mlp` by `sanitize`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlx_dspark.models.heads.mtp.layers import MTPLayers

PREFIX = "mtp."
# raw Hugging Face norms are stored as w - 1 (Qwen3-Next's zero-centred RMSNorm); mlx-lm's RMSNorm reads w
OFFSET_NORMS = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
    "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
)  # fmt: skip
MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # mlx-lm model types whose MTP layers this module builds
# a MoE layer's experts as Hugging Face stores them: fused (E, 2I, C) gate | up and (E, C, I) down, or one by one
FUSED_GATE_UP, FUSED_DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"
ONE_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)")


def text_config(config: dict) -> dict:
    """The language model's fields (a multimodal config nests them under `text_config`)."""
    text = config.get("text_config")
    return dict(text) if isinstance(text, dict) else dict(config)


def owns(config: dict, name: str) -> bool:
    """Whether a checkpoint tensor belongs to the MTP layers."""
    return name.startswith(PREFIX)


def mtp_layer_count(config: dict) -> int:
    """How many MTP layers a target config declares (`mtp_num_hidden_layers`; 0: none)."""
    value = text_config(config).get("mtp_num_hidden_layers", 0)
    return int(value) if isinstance(value, int) and value > 0 else 0


@dataclass
class MTPArgs:
    hidden_size: int
    rms_norm_eps: float
    mtp_num_hidden_layers: int
    layer_args: Any  # mlx-lm's qwen3_5.TextModelArgs of the target, every layer full attention

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "MTPArgs":
        text = text_config(config)
        layers = mtp_layer_count(config)
        if layers < 1:
            raise ValueError(f"{source}: text_config.mtp_num_hidden_layers is missing or 0: this target declares no MTP layers")
        args = qwen3_5.TextModelArgs.from_dict(text)
        return cls(
            hidden_size=args.hidden_size,
            rms_norm_eps=args.rms_norm_eps,
            mtp_num_hidden_layers=layers,
            layer_args=dataclasses.replace(args, full_attention_interval=1),
        )


class MTP(MTPLayers):
    """The MTP block; `raw_norms` True when the weights come from a raw HF checkpoint (norms stored as w - 1)."""

    def __init__(self, args: MTPArgs, *, raw_norms: bool = True):
        super().__init__()
        self.args = args
        self.raw_norms = raw_norms
        C, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(C, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(C, eps=eps)
        self.fc = nn.Linear(2 * C, C, bias=False)
        self.layers = [self.decoder_layer(args.layer_args, i) for i in range(args.mtp_num_hidden_layers)]
        self.norm = nn.RMSNorm(C, eps=eps)

    @staticmethod
    def decoder_layer(layer_args: Any, index: int) -> nn.Module:
        """MTP layer `index`: the family's full-attention decoder layer (models/heads/mtp/qwen3_next.py: its own)."""
        return qwen3_5.DecoderLayer(layer_args, layer_idx=0)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: Optional[list[KVCache]] = None, *, step: int = 0) -> mx.array:
        """embeddings (B, L, C) of tokens t+1, hidden (B, L, C) normed states at t -> normed MTP states (B, L, C).

        With several MTP layers all run in order on every step, whatever the `step`, as mlx-vlm does (vLLM's
        step k runs layer k mod n); loading/heads/mtp.py refuses more than one (every published checkpoint has 1)."""
        x = mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden.astype(embeddings.dtype))], axis=-1)
        x = self.fc(x)
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return self.norm(x)

    def logits(self, h: mx.array, target: Any, *, step: int = 0) -> mx.array:
        """Normed MTP states (B, L, C) -> (B, L, V) by the target's LM head."""
        return target.lm_head_logits(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """`mtp.*` names without the prefix; raw HF norms + 1 (as mlx-lm's qwen3_5 sanitize does for the target);
        a MoE layer's experts (Qwen3.5-MoE) stacked into mlx-lm's `switch_mlp`, from the fused `gate_up_proj` /
        `down_proj` (gate rows first, as mlx-lm's qwen3_5_moe sanitize splits the target's) or one by one."""
        out = {}
        for name, value in weights.items():
            key = name[len(PREFIX):] if name.startswith(PREFIX) else name
            if self.raw_norms and key.endswith(OFFSET_NORMS) and value.ndim == 1:
                value = value + 1.0
            out[key] = value
        return stack_experts(out)

    def checkpoint_name(self, name: str) -> str:
        """Our parameter name -> the name a conversion writes."""
        return PREFIX + name


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """MoE experts under mlx-lm's names: `<layer>.mlp.switch_mlp.{gate,up,down}_proj.weight` (E, out, in)."""
    out = dict(weights)
    for key in [k for k in weights if k.endswith(FUSED_GATE_UP)]:
        mlp = key[: -len(FUSED_GATE_UP)] + ".mlp.switch_mlp."
        gate, up = mx.split(out.pop(key), 2, axis=-2)
        out.update({mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up})
        out[mlp + "down_proj.weight"] = out.pop(key[: -len(FUSED_GATE_UP)] + FUSED_DOWN)
    groups: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    for key in [k for k in out if ONE_EXPERT.fullmatch(k)]:
        mlp, expert, proj, kind = ONE_EXPERT.fullmatch(key).groups()
        groups.setdefault((mlp, proj, kind), {})[int(expert)] = out.pop(key)
    for (mlp, proj, kind), experts in groups.items():
        out[f"{mlp}.switch_mlp.{proj}.{kind}"] = mx.stack([experts[e] for e in sorted(experts)])
    return out


def is_raw_hf(shapes: dict[str, Any]) -> bool:
    """Whether a qwen3_5 checkpoint (tensor name -> shape) is in raw HF form: its conv1d kernels not yet
    moved, mlx-lm's own test for adding 1 to the norms."""
    return any("conv1d.weight" in k and tuple(shape)[-1] != 1 for k, shape in shapes.items())
