"""A naive NumPy (float64) DSpark draft written from DSPARK.md section 3, for tests only.

Independent of `mlx_dspark.models.heads.dspark.model`: no caches (the context is recomputed from every feature
each call), dense visibility masks spelled out position by position, loops over heads, weights read
by their checkpoint names. Slow, but obviously the spec.
"""

from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def rope(x: np.ndarray, positions: np.ndarray, *, theta: float, dims: int) -> np.ndarray:
    """Rotate-half RoPE on the first `dims` dims; x (n, heads, D), positions (n,)."""
    half = dims // 2
    freqs = theta ** (-np.arange(half) * 2.0 / dims)
    angles = positions[:, None, None] * freqs[None, None, :]  # (n, 1, half)
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half], x[..., half:dims]
    rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return np.concatenate([rotated, x[..., dims:]], axis=-1)


class ReferenceDraft:
    """DSpark draft from a config dict and `{checkpoint name: array}` (DeepSpec names, no `model.` prefix)."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray]):
        self.c = config
        self.w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
        arch = (config.get("architectures") or [""])[0]
        self.family = {"Qwen3DSparkModel": "qwen3", "Spark2_5DSparkModel": "spark2_5"}.get(arch, config["model_type"])
        self.heads = config["num_attention_heads"]
        self.kv_heads = config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.heads
        self.eps = config["rms_norm_eps"]
        window = config.get("sliding_window")
        if self.family == "qwen3" and config.get("use_sliding_window") is False:
            window = None
        self.windows = [window if t == "sliding_attention" else None for t in config["layer_types"]]

    def _rope_params(self, layer: int) -> tuple[float, int]:
        if self.family == "qwen3":
            theta = self.c.get("rope_theta") or self.c["rope_parameters"]["rope_theta"]
            return theta, self.head_dim
        entry = self.c["rope_parameters"][self.c["layer_types"][layer]]
        return entry["rope_theta"], int(self.head_dim * entry.get("partial_rotary_factor", 1.0))

    def _attention(self, layer: int, x: np.ndarray, ctx: np.ndarray, p: int) -> np.ndarray:
        """x: normed block rows (L, H) at p..p+L-1; ctx: fused context c(0..p-1) (p, H)."""
        w, pre, D = self.w, f"layers.{layer}.self_attn.", self.head_dim
        L = x.shape[0]
        q_pos = np.arange(p, p + L, dtype=np.float64)
        c_pos = np.arange(p, dtype=np.float64)
        theta, dims = self._rope_params(layer)
        if self.family == "qwen3":

            def proj(rows, name):  # with its bias where the config has attention_bias
                return rows @ w[pre + name + ".weight"].T + w.get(pre + name + ".bias", 0.0)

            q = rms_norm(proj(x, "q_proj").reshape(L, self.heads, D), w[pre + "q_norm.weight"], self.eps)

            def kv(rows):
                k = proj(rows, "k_proj").reshape(len(rows), self.kv_heads, D)
                v = proj(rows, "v_proj").reshape(len(rows), self.kv_heads, D)
                return rms_norm(k, w[pre + "k_norm.weight"], self.eps), v

            gate = np.ones((L, self.heads))
        else:
            qrows, kvrows = self.heads * D, self.kv_heads * D
            W = w[pre + "q_k_v_proj.weight"]
            q = (x @ W[:qrows].T).reshape(L, self.heads, D)

            def kv(rows):
                k = (rows @ W[qrows : qrows + kvrows].T).reshape(len(rows), self.kv_heads, D)
                v = (rows @ W[qrows + kvrows :].T).reshape(len(rows), self.kv_heads, D)
                return k, v

            gate = sigmoid(x @ w[pre + "g_proj.weight"].T)  # (L, heads)
        k_ctx, v_ctx = kv(ctx)
        k_blk, v_blk = kv(x)
        q = rope(q, q_pos, theta=theta, dims=dims)
        keys = np.concatenate([rope(k_ctx, c_pos, theta=theta, dims=dims), rope(k_blk, q_pos, theta=theta, dims=dims)])
        values = np.concatenate([v_ctx, v_blk])
        # Dense visibility: the whole block; context t iff q - t < window (all t < p without a window).
        window = self.windows[layer]
        visible = np.zeros((L, p + L), dtype=bool)
        for i in range(L):
            for j in range(p + L):
                if j >= p:
                    visible[i, j] = True
                else:
                    visible[i, j] = window is None or (p + i) - j < window
        out = np.zeros((L, self.heads, D))
        group = self.heads // self.kv_heads
        for h in range(self.heads):
            scores = q[:, h] @ keys[:, h // group].T / math.sqrt(D)
            scores = np.where(visible, scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            out[:, h] = (probs @ values[:, h // group]) * gate[:, h : h + 1]
        out_name = "o_proj.weight" if self.family == "qwen3" else "out_proj.weight"
        return out.reshape(L, -1) @ w[pre + out_name].T + w.get(pre + "o_proj.bias", 0.0)

    def _mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        w, pre = self.w, f"layers.{layer}.mlp."
        g = x @ w[pre + "gate_proj.weight"].T
        act = g * sigmoid(g) if self.family == "qwen3" else 0.5 * g * (1.0 + _erf(g / math.sqrt(2.0)))
        return (act * (x @ w[pre + "up_proj.weight"].T)) @ w[pre + "down_proj.weight"].T

    def block_outputs(self, features: np.ndarray, anchor: int, embedding: np.ndarray) -> np.ndarray:
        """o(1..block_size) for one sequence: features (p, F) of positions 0..p-1, anchor at p."""
        w = self.w
        p = features.shape[0]
        ctx = rms_norm(np.asarray(features, np.float64) @ w["fc.weight"].T, w["hidden_norm.weight"], self.eps)
        ids = [anchor] + [self.c["mask_token_id"]] * (self.c["block_size"] - 1)
        h = np.asarray(embedding, np.float64)[ids]
        for i in range(self.c["num_hidden_layers"]):
            pre = f"layers.{i}."
            h = h + self._attention(i, rms_norm(h, w[pre + "input_layernorm.weight"], self.eps), ctx, p)
            h = h + self._mlp(i, rms_norm(h, w[pre + "post_attention_layernorm.weight"], self.eps))
        return rms_norm(h, w["norm.weight"], self.eps)

    def draft(
        self,
        features: np.ndarray,
        anchor: int,
        *,
        embedding: np.ndarray,
        lm_head: np.ndarray,
        tokens: list[int] | None = None,
        num_tokens: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Base logits z, final logits, tokens (argmax, or `tokens` teacher-forced) and confidence."""
        w, c = self.w, self.c
        o = self.block_outputs(features, anchor, embedding)
        K = num_tokens or c["block_size"]
        base = o @ np.asarray(lm_head, np.float64).T  # z(k) on row k-1
        rank = c["markov_rank"]
        head_type = c.get("markov_head_type")
        prev, state = anchor, np.zeros(rank)
        final, drafted, conf = [], [], []
        for k in range(K):
            logits = base[k].copy()
            e = w["markov_head.markov_w1.weight"][prev] if rank else np.zeros(0)
            if rank:
                w2 = w["markov_head.markov_w2.weight"]  # (V, r)
                if head_type == "vanilla":
                    logits += w2 @ e
                elif head_type == "gated":
                    g = sigmoid(w["markov_head.gate_proj.weight"] @ np.concatenate([o[k], e]) + w["markov_head.gate_proj.bias"])
                    logits += w2 @ (g * e)
                else:  # rnn
                    z = w["markov_head.joint_proj.weight"] @ np.concatenate([state, e, o[k]]) + w["markov_head.joint_proj.bias"]
                    a, b, u = z[:rank], z[rank : 2 * rank], z[2 * rank :]
                    state = sigmoid(a) * state + (1 - sigmoid(a)) * np.tanh(b)
                    logits += w2 @ np.tanh(u)
            if c.get("enable_confidence_head"):
                feat = np.concatenate([o[k], e]) if c.get("confidence_head_with_markov") else o[k]
                conf.append(sigmoid(w["confidence_head.proj.weight"][0] @ feat + w["confidence_head.proj.bias"][0]))
            token = int(np.argmax(logits)) if tokens is None else int(tokens[k])
            final.append(logits)
            drafted.append(token)
            prev = token
        final = np.stack(final)
        token_probs = np.exp(log_softmax(final).max(axis=-1))  # the top probability (p_min is decided before a draw)
        return {
            "hidden": o,
            "base_logits": base,
            "logits": final,
            "tokens": np.array(drafted),
            "token_probs": token_probs,
            "confidence": np.array(conf) if conf else None,
        }
