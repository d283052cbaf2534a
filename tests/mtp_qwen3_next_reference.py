"""An independent NumPy restatement of Qwen3-Next's MTP step, read straight from the HF safetensors.

Qwen3.5's restatement (tests/mtp_reference.py: zero-centred norms, fc over [norm_e(embed), norm_h(h_t)],
gated-q attention with q/k norms and partial neox RoPE, the final norm, the target's head, the chain fed its
own output) with what Qwen3-Next changes (vLLM `qwen3_next.py`, `Qwen3NextSparseMoeBlock`; transformers'
Qwen3-Next): the flat config, `model.embed_tokens`, and the MLP a sparse MoE: softmax router over all experts,
the top k (renormalised when `norm_topk_prob`), each a SwiGLU expert, plus the shared SwiGLU expert scaled by
sigmoid(shared_expert_gate). Nothing here imports mlx_dspark or mlx-lm modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.mtp_reference import MTPReference


class Qwen3NextMTPReference(MTPReference):
    EMBED = "model.embed_tokens.weight"

    def __init__(self, path: str | Path):
        super().__init__(path)
        c = json.loads((Path(path) / "config.json").read_text())
        self.rot = int(self.head_dim * c["partial_rotary_factor"])
        self.theta = c["rope_theta"]
        self.top_k, self.renormalise = c["num_experts_per_tok"], c["norm_topk_prob"]
        self.experts = c["num_experts"]

    def swiglu(self, x: np.ndarray, p: str) -> np.ndarray:
        g, u = x @ self.w[f"{p}.gate_proj.weight"].T, x @ self.w[f"{p}.up_proj.weight"].T
        return (g / (1.0 + np.exp(-g)) * u) @ self.w[f"{p}.down_proj.weight"].T

    def mlp(self, x: np.ndarray, p: str) -> np.ndarray:
        router = x @ self.w[f"{p}.gate.weight"].T  # (n, E)
        probs = np.exp(router - router.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for i in range(x.shape[0]):
            chosen = np.argsort(-probs[i])[: self.top_k]
            weights = probs[i, chosen] / (probs[i, chosen].sum() if self.renormalise else 1.0)
            for e, w in zip(chosen, weights):
                out[i] += w * self.swiglu(x[i : i + 1], f"{p}.experts.{e}")[0]
        shared_gate = 1.0 / (1.0 + np.exp(-(x @ self.w[f"{p}.shared_expert_gate.weight"].T)))  # (n, 1)
        return out + shared_gate * self.swiglu(x, f"{p}.shared_expert")
