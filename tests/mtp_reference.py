"""An independent NumPy restatement of Qwen3.5's MTP step, read straight from the HF safetensors.

Written from the published math (DRAFTERS.md section 2; vLLM `qwen3_next_mtp.py`; transformers'
Qwen3-Next attention): zero-centred RMSNorms (weight 1 + w), fc over [norm_e(embed(t+1)), norm_h(h_t)],
a decoder layer whose q_proj gives per head [query | gate], q/k RMSNorm, partial neox RoPE at position
t, causal GQA attention, sigmoid-gated output, SwiGLU MLP, the final norm and the target's lm_head.
A Qwen3.5-MoE layer's MLP (transformers' Qwen3.5-MoE sparse block) is a softmax router over the experts,
the top `num_experts_per_tok` (renormalised when `norm_topk_prob`, true unless the config says otherwise),
each a SwiGLU expert whose fused `gate_up_proj` holds the gate rows then the up rows, plus the shared SwiGLU
expert scaled by sigmoid(shared_expert_gate). Nothing here imports mlx_dspark or mlx-lm modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


class MTPReference:
    EMBED = "model.language_model.embed_tokens.weight"  # the target's embedding (under the multimodal wrapper)

    def __init__(self, path: str | Path):
        path = Path(path)
        self.w = {}
        for file in sorted(path.glob("*.safetensors")):
            self.w.update({k: v.astype(np.float64) for k, v in load_file(str(file)).items()})
        config = json.loads((path / "config.json").read_text())
        self.cfg = config.get("text_config", config)
        c = self.cfg
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        rope = c.get("rope_parameters") or {}
        self.rot = int(self.head_dim * rope.get("partial_rotary_factor", 0.25))
        self.theta = rope.get("rope_theta", 10000.0)
        self.eps = c["rms_norm_eps"]
        tied = c.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        self.embed_table = self.w[self.EMBED]
        self.head = self.embed_table if tied else self.w["lm_head.weight"]

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * (1.0 + self.w[name])

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:  # x (n, heads, D)
        half = self.rot // 2
        inv = self.theta ** (-np.arange(0, self.rot, 2) / self.rot)  # (half,)
        ang = positions[:, None] * inv[None]  # (n, half)
        cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
        a, b = x[..., :half], x[..., half : self.rot]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin, x[..., self.rot :]], axis=-1)

    def attention(self, x: np.ndarray, positions: np.ndarray, p: str) -> np.ndarray:
        n, D, H, KV = x.shape[0], self.head_dim, self.heads, self.kv_heads
        qg = (x @ self.w[f"{p}.q_proj.weight"].T).reshape(n, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(n, H * D)
        k = (x @ self.w[f"{p}.k_proj.weight"].T).reshape(n, KV, D)
        v = (x @ self.w[f"{p}.v_proj.weight"].T).reshape(n, KV, D)
        q = self.rope(self.norm(q, f"{p}.q_norm.weight"), positions)
        k = self.rope(self.norm(k, f"{p}.k_norm.weight"), positions)
        out = np.zeros((n, H, D))
        causal = np.tril(np.ones((n, n), bool))
        for h in range(H):
            kh, vh = k[:, h // (H // KV)], v[:, h // (H // KV)]
            scores = np.where(causal, q[:, h] @ kh.T / np.sqrt(D), -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, h] = (probs / probs.sum(-1, keepdims=True)) @ vh
        return (out.reshape(n, H * D) / (1.0 + np.exp(-gate))) @ self.w[f"{p}.o_proj.weight"].T

    def mlp(self, x: np.ndarray, p: str) -> np.ndarray:
        if f"{p}.experts.gate_up_proj" in self.w:
            return self.sparse_moe(x, p)
        g, u = x @ self.w[f"{p}.gate_proj.weight"].T, x @ self.w[f"{p}.up_proj.weight"].T
        return (g / (1.0 + np.exp(-g)) * u) @ self.w[f"{p}.down_proj.weight"].T

    def sparse_moe(self, x: np.ndarray, p: str) -> np.ndarray:
        router = x @ self.w[f"{p}.gate.weight"].T  # (n, E)
        probs = np.exp(router - router.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        gate_up, down = self.w[f"{p}.experts.gate_up_proj"], self.w[f"{p}.experts.down_proj"]  # (E, 2I, C), (E, C, I)
        inner = gate_up.shape[1] // 2
        out = np.zeros_like(x)
        for i in range(x.shape[0]):
            chosen = np.argsort(-probs[i])[: self.cfg["num_experts_per_tok"]]
            weights = probs[i, chosen] / (probs[i, chosen].sum() if self.cfg.get("norm_topk_prob", True) else 1.0)
            for e, weight in zip(chosen, weights):
                g, u = gate_up[e, :inner] @ x[i], gate_up[e, inner:] @ x[i]
                out[i] += weight * (down[e] @ (g / (1.0 + np.exp(-g)) * u))
        shared = self.mlp(x, f"{p}.shared_expert")
        return out + shared / (1.0 + np.exp(-(x @ self.w[f"{p}.shared_expert_gate.weight"].T)))

    def hidden(self, next_tokens: list[int], hidden: np.ndarray) -> np.ndarray:
        """MTP output states (n, C) for entries t = 0..n-1: (hidden[t], next_tokens[t]) at position t."""
        e = self.norm(self.embed_table[np.array(next_tokens)], "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(hidden.astype(np.float64), "mtp.pre_fc_norm_hidden.weight")
        x = np.concatenate([e, h], axis=-1) @ self.w["mtp.fc.weight"].T
        positions = np.arange(x.shape[0], dtype=np.float64)
        p = "mtp.layers.0"
        x = x + self.attention(self.norm(x, f"{p}.input_layernorm.weight"), positions, f"{p}.self_attn")
        x = x + self.mlp(self.norm(x, f"{p}.post_attention_layernorm.weight"), f"{p}.mlp")
        return self.norm(x, "mtp.norm.weight")

    def logits(self, next_tokens: list[int], hidden: np.ndarray) -> np.ndarray:
        return self.hidden(next_tokens, hidden) @ self.head.T

    def greedy_chain(self, next_tokens: list[int], hidden: np.ndarray, steps: int) -> list[int]:
        """k chained greedy drafts after the entries: each step feeds its own output state back."""
        tokens, states = list(next_tokens), [row for row in hidden.astype(np.float64)]
        drafts = []
        for _ in range(steps):
            out = self.hidden(tokens, np.stack(states))
            drafts.append(int(np.argmax(out[-1] @ self.head.T)))
            tokens.append(drafts[-1])
            states.append(out[-1])
        return drafts
