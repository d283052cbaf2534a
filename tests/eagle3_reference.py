"""An independent NumPy restatement of an EAGLE-3 draft over a llama target, read straight from the
safetensors files (float64).

Written from vLLM `llama_eagle3.py` / `llama.py` and speculators `models/eagle3`: the target's Hugging Face
hidden states (index 0 the embedding output, index i the residual stream entering layer i, so the output
of layer i - 1), the three at `eagle_aux_hidden_state_layer_ids` concatenated in layer order; g = fc(.);
one layer (qwen3: per-head q/k RMSNorms before RoPE) on [input_layernorm(embed(token t+1)) | hidden_norm(g_t)] at position t, the residual g (or
hidden_norm(g) with norm_before_residual), causal GQA attention with rotate-half RoPE, SwiGLU MLP; logits
lm_head(norm(h)) on the draft rows, row i being target id i + d2t[i]; a chain feeds h (pre-norm) back in
place of g. Nothing here imports mlx_dspark or mlx-lm.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def read(path: Path) -> tuple[dict, dict]:
    weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return json.loads((Path(path) / "config.json").read_text()), weights


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def scaled_frequencies(inv: np.ndarray, scaling: dict | None) -> np.ndarray:
    """transformers' rope_type 'linear' (every frequency / factor) and 'llama3' (wavelengths above
    original_max / low_freq_factor divided by factor, below original_max / high_freq_factor kept, a
    linear blend in between on original_max / wavelength)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    factor = scaling["factor"]
    if kind == "linear":
        return inv / factor
    assert kind == "llama3", kind
    old, low, high = scaling["original_max_position_embeddings"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * np.pi / inv
    blend = np.clip((old / wavelength - low) / (high - low), 0.0, 1.0)
    return (1 - blend) * inv / factor + blend * inv


def rope(x: np.ndarray, positions: np.ndarray, theta: float, scaling: dict | None = None) -> np.ndarray:  # x (n, heads, D), rotate-half
    D = x.shape[-1]
    inv = scaled_frequencies(theta ** (-np.arange(0, D, 2) / D), scaling)
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def attention(x: np.ndarray, w: dict, p: str, *, heads: int, kv_heads: int, head_dim: int, theta: float, eps: float,
              scaling: dict | None = None) -> np.ndarray:
    n, H, KV, D = x.shape[0], heads, kv_heads, head_dim
    positions = np.arange(n, dtype=np.float64)
    q = (x @ w[f"{p}.q_proj.weight"].T).reshape(n, H, D)
    k = (x @ w[f"{p}.k_proj.weight"].T).reshape(n, KV, D)
    if f"{p}.q_norm.weight" in w:  # a qwen3 layer: per-head RMSNorm of q and k before RoPE
        q, k = rms(q, w[f"{p}.q_norm.weight"], eps), rms(k, w[f"{p}.k_norm.weight"], eps)
    q, k = rope(q, positions, theta, scaling), rope(k, positions, theta, scaling)
    v = (x @ w[f"{p}.v_proj.weight"].T).reshape(n, KV, D)
    out = np.zeros((n, H, D))
    causal = np.tril(np.ones((n, n), bool))
    for h in range(H):
        kh, vh = k[:, h // (H // KV)], v[:, h // (H // KV)]
        scores = np.where(causal, q[:, h] @ kh.T / np.sqrt(D), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (probs / probs.sum(-1, keepdims=True)) @ vh
    return out.reshape(n, H * D) @ w[f"{p}.o_proj.weight"].T


def mlp(x: np.ndarray, w: dict, p: str) -> np.ndarray:
    g, u = x @ w[f"{p}.gate_proj.weight"].T, x @ w[f"{p}.up_proj.weight"].T
    return (g / (1.0 + np.exp(-g)) * u) @ w[f"{p}.down_proj.weight"].T


class LlamaTarget:
    """The tiny llama target's Hugging Face hidden states."""

    def __init__(self, path: str | Path):
        self.cfg, raw = read(Path(path))
        self.w = {k: v.astype(np.float64) for k, v in raw.items()}
        c = self.cfg
        self.shape = dict(heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"],
                          head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"], theta=c.get("rope_theta", 10000.0),
                          eps=c["rms_norm_eps"])  # fmt: skip
        self.embed_table = self.w["model.embed_tokens.weight"]

    def hidden_states(self, tokens: list[int]) -> list[np.ndarray]:
        """[embedding output, output of layer 0, ..., output of layer N - 1 (before the final norm)]."""
        x = self.embed_table[np.array(tokens)]
        states, eps = [x], self.cfg["rms_norm_eps"]
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}"
            x = x + attention(rms(x, self.w[f"{p}.input_layernorm.weight"], eps), self.w, f"{p}.self_attn", **self.shape)
            x = x + mlp(rms(x, self.w[f"{p}.post_attention_layernorm.weight"], eps), self.w, f"{p}.mlp")
            states.append(x)
        return states


class Eagle3Reference:
    def __init__(self, path: str | Path, embed_table: np.ndarray):
        self.cfg, raw = read(Path(path))
        self.w = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in raw.items()}
        layer = self.cfg["transformer_layer_config"]
        if "d2t" in self.w:
            self.ids = np.arange(self.w["d2t"].size) + self.w["d2t"].astype(np.int64)  # target id of each draft row
        else:  # no table: the draft's rows are the target's vocabulary
            self.ids = np.arange(layer["vocab_size"])
        self.w = {k: v.astype(np.float64) for k, v in self.w.items() if k not in ("d2t", "t2d")}
        self.eps, self.vocab = layer["rms_norm_eps"], layer["vocab_size"]
        self.shape = dict(heads=layer["num_attention_heads"], kv_heads=layer["num_key_value_heads"],
                          head_dim=layer["head_dim"], theta=layer.get("rope_theta", 10000.0), eps=layer["rms_norm_eps"],
                          scaling=layer.get("rope_scaling"))  # fmt: skip
        own = self.w.get("embed_tokens.weight")
        # the draft's own table when it trained one, or when its width is not the target's (vLLM shares the target's
        # table only when the shapes match)
        if own is not None and (self.cfg.get("embed_requires_grad") or own.shape != embed_table.shape):
            embed_table = own
        self.embed_table = embed_table
        self.before_residual = self.cfg.get("norm_before_residual", False)

    def aux(self, states: list[np.ndarray], num_layers: int) -> np.ndarray:
        ids = self.cfg.get("eagle_aux_hidden_state_layer_ids") or [2, num_layers // 2, num_layers - 3]
        return np.concatenate([states[i] for i in sorted(ids)], axis=-1)

    def fuse(self, aux: np.ndarray) -> np.ndarray:
        if self.cfg.get("norm_before_fc"):  # speculators' input_norm over the concatenated taps (gpt-oss drafts)
            aux = rms(aux, self.w["input_norm.weight"], self.eps)
        return aux @ self.w["fc.weight"].T

    def outputs(self, next_tokens: list[int], hidden: np.ndarray) -> np.ndarray:
        """Pre-norm outputs (n, C) of entries t = 0..n-1: (hidden[t], next_tokens[t]) at position t."""
        p = "layers.0"
        e = rms(self.embed_table[np.array(next_tokens)], self.w[f"{p}.input_layernorm.weight"], self.eps)
        n = rms(hidden, self.w[f"{p}.hidden_norm.weight"], self.eps)
        residual = n if self.before_residual else hidden
        x = residual + attention(np.concatenate([e, n], axis=-1), self.w, f"{p}.self_attn", **self.shape)
        return x + mlp(rms(x, self.w[f"{p}.post_attention_layernorm.weight"], self.eps), self.w, f"{p}.mlp")

    def logits(self, h: np.ndarray) -> np.ndarray:
        """(n, C) -> (n, V) over the target vocabulary, -inf outside the draft's rows."""
        full = np.full((h.shape[0], self.vocab), -np.inf)
        full[:, self.ids] = rms(h, self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T
        return full

    def greedy_chain(self, next_tokens: list[int], g: np.ndarray, steps: int) -> list[int]:
        """k chained greedy drafts after the entries: each step feeds its own pre-norm output back."""
        tokens, rows, drafts = list(next_tokens), [r for r in g], []
        for _ in range(steps):
            h = self.outputs(tokens, np.stack(rows))[-1]
            drafts.append(int(np.argmax(self.logits(h[None])[0])))
            tokens.append(drafts[-1])
            rows.append(h)
        return drafts
