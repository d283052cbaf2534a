"""An independent NumPy restatement of MiMo's MTP step, read straight from the HF safetensors.

Written from the published math (DRAFTERS.md section 2; vLLM `mimo_mtp.py` and `qwen2.py`, MiMo's
`modeling_mimo.py`): MTP layer i at `model.mtp_layers.<i>` reads e = embed(token_{t+1}) from the target's
`model.embed_tokens` (zero at position 0) and the target's final normed state h_t,
x = input_proj([hidden_layernorm(h_t), token_layernorm(e)]) (the hidden state first), runs its Qwen2
decoder block (pre-norm residual attention with biased q/k/v, GQA, neox RoPE over the whole head,
scale head_dim^-1/2; then a SwiGLU MLP), and returns final_layernorm of the block's output; the logits
are the target's lm_head (or its tied embedding) of that. A chain feeds that normed output back as the
next hidden state; step k uses layer k mod n. Nothing here imports mlx_dspark or mlx-lm modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class MiMoMTPReference:
    def __init__(self, path: str | Path):
        path = Path(path)
        self.w = {}
        for file in sorted(path.glob("*.safetensors")):
            self.w.update({k: v.astype(np.float64) for k, v in load_file(str(file)).items()})
        self.c = c = json.loads((path / "config.json").read_text())
        self.eps, self.heads, self.kv_heads = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c["hidden_size"] // self.heads
        self.n = c["num_nextn_predict_layers"]

    def layer(self, step: int) -> str:
        return f"model.mtp_layers.{step % self.n}"

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * self.w[name]

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x (n, H, D): rotate halves (neox) over the whole head."""
        D = x.shape[-1]
        ang = positions[:, None] * self.c["rope_theta"] ** (-np.arange(0, D, 2) / D)[None]  # (n, D / 2)
        cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
        a, b = x[..., : D // 2], x[..., D // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def attention(self, x: np.ndarray, p: str) -> np.ndarray:
        """Causal GQA over rows at positions 0 .. n-1 -> (n, C)."""
        w, n, D = self.w, len(x), self.head_dim
        q, k, v = ((x @ w[f"{p}.{t}_proj.weight"].T + w[f"{p}.{t}_proj.bias"]).reshape(n, -1, D) for t in "qkv")
        positions = np.arange(n, dtype=np.float64)
        q, k = self.rope(q, positions), self.rope(k, positions)
        group = self.heads // self.kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("ihd,jhd->hij", q, k) * D**-0.5
        scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        return np.einsum("hij,jhd->ihd", probs, v).reshape(n, -1) @ w[f"{p}.o_proj.weight"].T

    def block(self, x: np.ndarray, p: str) -> np.ndarray:
        """The Qwen2 decoder block, then the layer's final_layernorm -> normed outputs (n, C)."""
        w = self.w
        h = x + self.attention(self.norm(x, f"{p}.input_layernorm.weight"), f"{p}.self_attn")
        m = self.norm(h, f"{p}.post_attention_layernorm.weight")
        h = h + (_silu(m @ w[f"{p}.mlp.gate_proj.weight"].T) * (m @ w[f"{p}.mlp.up_proj.weight"].T)) @ w[f"{p}.mlp.down_proj.weight"].T
        return self.norm(h, f"{p}.final_layernorm.weight")

    def inputs(self, tokens: list[int], hidden: np.ndarray, step: int, first_position: int) -> np.ndarray:
        """input_proj rows for (token_{t+1}, h_t) pairs whose positions start at `first_position`."""
        p = self.layer(step)
        embed = self.w["model.embed_tokens.weight"][tokens]
        if first_position == 0:
            embed[0] = 0.0
        x = np.concatenate([self.norm(hidden, f"{p}.hidden_layernorm.weight"), self.norm(embed, f"{p}.token_layernorm.weight")], axis=-1)
        return x @ self.w[f"{p}.input_proj.weight"].T

    def logits(self, out: np.ndarray) -> np.ndarray:
        return out @ self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"]).T

    def step_logits(self, tokens: list[int], hidden: np.ndarray, step: int = 0) -> np.ndarray:
        """One step of layer `step` mod n over entries 0 .. n-1 (its own cache empty before) -> (n, V)."""
        return self.logits(self.block(self.inputs(tokens, hidden, step, 0), self.layer(step)))

    def greedy_chain(self, tokens: list[int], hidden: np.ndarray, k: int) -> tuple[list[int], list[float]]:
        """k greedy drafts and each one's probability: the committed entries (token t+1, h_t), then k - 1
        chained entries, each the previous step's normed output beside its draft's embedding (one layer)."""
        assert self.n == 1
        p = self.layer(0)
        rows = self.inputs(tokens, hidden, 0, 0)
        drafts, probs = [], []
        for _ in range(k):
            out = self.block(rows, p)
            logits = self.logits(out[-1])
            drafts.append(int(np.argmax(logits)))
            probs.append(float(1.0 / np.exp(logits - logits.max()).sum()))
            rows = np.concatenate([rows, self.inputs([drafts[-1]], out[-1:], 0, len(rows))])
        return drafts, probs
