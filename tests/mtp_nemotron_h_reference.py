"""An independent NumPy restatement of Nemotron-H's MTP step, read straight from the HF safetensors.

Written from the published math (vLLM `nemotron_h_mtp.py` and `nemotron_h.py`; HF transformers'
`NemotronHConfig`): the block `mtp.layers.0 .. len(mtp_layers_block_type) - 1` reads e = the target's
`backbone.embeddings` of token t+1 and the target's final normed state h_t; x = eh_proj([enorm(e), hnorm(h_t)])
(the embedding first, plain RMSNorms); each layer adds its mixer of its pre-norm `norm(x)`: attention (GQA, no
positional encoding, scale head_dim^-1/2, causal over the MTP's own entries) or the MoE (sigmoid router, top k
chosen on the scores plus `e_score_correction_bias`, weighted by the unbiased scores, renormalised when
`norm_topk_prob`, times `routed_scaling_factor`; experts and the shared expert down(relu(up(x))^2)); the last
layer's `final_layernorm`; logits by the target's `lm_head`. A chain feeds the normed output back. Nothing
here imports mlx_dspark or mlx-lm modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def _relu2(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0) ** 2


class NemotronHMTPReference:
    def __init__(self, path: str | Path):
        path = Path(path)
        self.w = {}
        for file in sorted(path.glob("*.safetensors")):
            self.w.update({k: v.astype(np.float64) for k, v in load_file(str(file)).items()})
        self.c = c = json.loads((path / "config.json").read_text())
        self.eps, self.heads, self.kv_heads, self.head_dim = c["layer_norm_epsilon"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.kinds = c["mtp_layers_block_type"]

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * self.w[name]

    def attention(self, x: np.ndarray, p: str) -> np.ndarray:
        n, D, H, KV = x.shape[0], self.head_dim, self.heads, self.kv_heads
        q = (x @ self.w[f"{p}.q_proj.weight"].T).reshape(n, H, D)
        k = (x @ self.w[f"{p}.k_proj.weight"].T).reshape(n, KV, D)
        v = (x @ self.w[f"{p}.v_proj.weight"].T).reshape(n, KV, D)
        out = np.zeros((n, H, D))
        causal = np.tril(np.ones((n, n), bool))
        for h in range(H):
            kh, vh = k[:, h // (H // KV)], v[:, h // (H // KV)]
            scores = np.where(causal, q[:, h] @ kh.T / np.sqrt(D), -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, h] = (probs / probs.sum(-1, keepdims=True)) @ vh
        return out.reshape(n, H * D) @ self.w[f"{p}.o_proj.weight"].T

    def expert(self, x: np.ndarray, p: str) -> np.ndarray:
        return _relu2(x @ self.w[f"{p}.up_proj.weight"].T) @ self.w[f"{p}.down_proj.weight"].T

    def moe(self, x: np.ndarray, p: str) -> np.ndarray:
        c = self.c
        scores = 1.0 / (1.0 + np.exp(-(x @ self.w[f"{p}.gate.weight"].T)))  # (n, E)
        biased = scores + self.w[f"{p}.gate.e_score_correction_bias"]
        out = np.zeros_like(x)
        for i in range(x.shape[0]):
            chosen = np.argsort(-biased[i])[: c["num_experts_per_tok"]]
            weights = scores[i, chosen]
            if c["norm_topk_prob"] and len(chosen) > 1:
                weights = weights / (weights.sum() + 1e-20)
            for e, w in zip(chosen, weights * c["routed_scaling_factor"]):
                out[i] += w * self.expert(x[i : i + 1], f"{p}.experts.{e}")[0]
        return out + self.expert(x, f"{p}.shared_experts")

    def hidden(self, next_tokens: list[int], hidden: np.ndarray) -> np.ndarray:
        """MTP outputs (n, C) for entries t = 0 .. n-1: (hidden[t], next_tokens[t])."""
        e = self.norm(self.w["backbone.embeddings.weight"][np.array(next_tokens)], "mtp.layers.0.enorm.weight")
        h = self.norm(hidden.astype(np.float64), "mtp.layers.0.hnorm.weight")
        x = np.concatenate([e, h], axis=-1) @ self.w["mtp.layers.0.eh_proj.weight"].T
        for j, kind in enumerate(self.kinds):
            p = f"mtp.layers.{j}"
            mixer = self.attention if kind == "attention" else self.moe
            x = x + mixer(self.norm(x, f"{p}.norm.weight"), f"{p}.mixer")
        return self.norm(x, f"mtp.layers.{len(self.kinds) - 1}.final_layernorm.weight")

    def logits(self, next_tokens: list[int], hidden: np.ndarray) -> np.ndarray:
        return self.hidden(next_tokens, hidden) @ self.w["lm_head.weight"].T

    def greedy_chain(self, next_tokens: list[int], hidden: np.ndarray, steps: int) -> tuple[list[int], list[float]]:
        """k chained greedy drafts and each one's probability: each step feeds its own output back."""
        tokens, states = list(next_tokens), [row for row in hidden.astype(np.float64)]
        drafts, probs = [], []
        for _ in range(steps):
            out = self.hidden(tokens, np.stack(states))
            logits = out[-1] @ self.w["lm_head.weight"].T
            drafts.append(int(np.argmax(logits)))
            probs.append(float(1.0 / np.exp(logits - logits.max()).sum()))
            tokens.append(drafts[-1])
            states.append(out[-1])
        return drafts, probs
