"""A plain NumPy float64 restatement of the Spark2_5ForCausalLM forward (DSPARK.md section 2).

Written from the formulas, not from the MLX model: its own RoPE, masks, softmax, RMSNorm and an erf
GELU via `math.erf`. Weights are a dict of Hugging Face names -> arrays; one sequence at a time.
"""

from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf)


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, positions: np.ndarray, *, theta: float, rotary_dims: int) -> np.ndarray:
    """Rotate-half RoPE on the first `rotary_dims` dims of x (T, D); frequencies theta^(-2i/r)."""
    r = rotary_dims
    inv_freq = theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)  # (r/2,)
    angles = positions[:, None].astype(np.float64) * inv_freq[None]  # (T, r/2)
    cos = np.cos(np.concatenate([angles, angles], axis=-1))
    sin = np.sin(np.concatenate([angles, angles], axis=-1))
    x_rot, x_pass = x[:, :r], x[:, r:]
    rotated_half = np.concatenate([-x_rot[:, r // 2 :], x_rot[:, : r // 2]], axis=-1)
    return np.concatenate([x_rot * cos + rotated_half * sin, x_pass], axis=-1)


def visible(q: int, k: int, window: int | None) -> bool:
    """Whether query position q sees key position k."""
    if k > q:
        return False
    return window is None or q - k < window


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention(config: dict, w: dict, prefix: str, x: np.ndarray, layer_type: str) -> np.ndarray:
    T = x.shape[0]
    H, Hkv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    qkv = x @ w[prefix + "q_k_v_proj.weight"].T
    q = qkv[:, : H * D].reshape(T, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].reshape(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D :].reshape(T, Hkv, D)
    params = config["rope_parameters"][layer_type]
    r = int(D * params.get("partial_rotary_factor", 1.0))
    positions = np.arange(T)
    window = config["sliding_window"] if layer_type == "sliding_attention" else None
    allowed = np.array([[visible(i, j, window) for j in range(T)] for i in range(T)])
    gate = sigmoid(x @ w[prefix + "g_proj.weight"].T)  # (T, H)
    out = np.zeros((T, H, D))
    for h in range(H):
        kv = h // (H // Hkv)
        qh = rope(q[:, h], positions, theta=params["rope_theta"], rotary_dims=r)
        kh = rope(k[:, kv], positions, theta=params["rope_theta"], rotary_dims=r)
        scores = qh @ kh.T / math.sqrt(D)
        scores = np.where(allowed, scores, -np.inf)
        out[:, h] = (softmax(scores) @ v[:, kv]) * gate[:, h : h + 1]
    return out.reshape(T, H * D) @ w[prefix + "out_proj.weight"].T


def forward(config: dict, weights: dict, ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits (T, V) and hidden states [x0 (embedding), x1, ..., xN] for one sequence of ids (T,)."""
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    eps = config["rms_norm_eps"]
    x = w["model.embedding.weight"][np.asarray(ids)]
    hidden = [x]
    for i, layer_type in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        x = x + attention(config, w, p + "self_attn.", rms_norm(x, w[p + "input_layernorm.weight"], eps), layer_type)
        y = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        mlp = gelu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ w[p + "mlp.down_proj.weight"].T
        hidden.append(x)
    head = w["model.embedding.weight"] if config.get("tie_word_embeddings", True) else w["lm_head.weight"]
    return rms_norm(x, w["model.norm.weight"], eps) @ head.T, hidden
