"""An independent NumPy restatement of a Gemma 4 assistant drafter's step (transformers'
`Gemma4AssistantForCausalLM.forward` over Gemma 4 text layers, driven as its single-position candidate
generator: every chained step at the state's position, the target's K/V unchanged), read from the checkpoint
files, and of the K/V the target's layers hand it (k_proj, k_norm, RoPE; v_proj, the scale-free v_norm) from
those layers' inputs. Float64 throughout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def rms(x: np.ndarray, weight: np.ndarray | None, eps: float = 1e-6) -> np.ndarray:
    out = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return out if weight is None else out * weight


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def inv_freq(params: dict, head_dim: int) -> np.ndarray:
    """Per rotate-half pair: theta^(-2i / head_dim) for the first partial_rotary_factor of the pairs, 0 (no turn) after."""
    turned = int(head_dim * params.get("partial_rotary_factor", 1.0)) // 2
    freq = params["rope_theta"] ** (-2.0 * np.arange(head_dim // 2) / head_dim)
    freq[turned:] = 0.0
    return freq


def rope(x: np.ndarray, positions: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """x (..., L, D) at `positions` (L,): pairs (i, i + D/2) turned by position * freq[i]."""
    angle = positions[:, None] * freq[None]  # (L, D/2)
    cos, sin = np.cos(angle), np.sin(angle)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class GemmaTargetKV:
    """The keys / values a tiny gemma4_text target's layer writes, from that layer's input states; `source(kind)`
    the layer whose K/V a layer of that type shares: the last of that type before the KV-shared layers
    (`num_kv_shared_layers`, the last ones)."""

    def __init__(self, path: Path):
        self.cfg = json.loads((path / "config.json").read_text())
        self.w = {k: v.astype(np.float64) for k, v in load_file(str(path / "model.safetensors")).items()}
        self.embed_table = self.w["model.embed_tokens.weight"]

    def source(self, kind: str) -> int:
        own = self.cfg["layer_types"][: self.cfg["num_hidden_layers"] - (self.cfg.get("num_kv_shared_layers") or 0)]
        return max(i for i, t in enumerate(own) if t == kind)

    def kv(self, layer: int, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """inputs (L, C) of `layer` -> keys, values (KV, L, D) at positions 0 .. L-1."""
        cfg, p = self.cfg, f"model.layers.{layer}."
        kind = cfg["layer_types"][layer]
        D = cfg["global_head_dim"] if kind == "full_attention" else cfg["head_dim"]
        a = rms(inputs, self.w[p + "input_layernorm.weight"])
        raw_keys = (a @ self.w[p + "self_attn.k_proj.weight"].T).reshape(len(a), -1, D)
        # attention_k_eq_v (a full layer without v_proj): the values are the raw keys
        v_proj = self.w.get(p + "self_attn.v_proj.weight")
        values = rms(raw_keys if v_proj is None else (a @ v_proj.T).reshape(len(a), -1, D), None)
        keys = rms(raw_keys, self.w[p + "self_attn.k_norm.weight"])
        keys = rope(keys.transpose(1, 0, 2), np.arange(len(a), dtype=np.float64), inv_freq(cfg["rope_parameters"][kind], D))
        return keys, values.transpose(1, 0, 2)


class AssistantReference:
    def __init__(self, path: Path, embed_table: np.ndarray):
        self.cfg = json.loads((path / "config.json").read_text())
        self.text = self.cfg["text_config"]
        self.w = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in load_file(str(path / "model.safetensors")).items()}
        self.embed_table = embed_table  # the target's

    def step(self, token: int, h: np.ndarray, kv: dict, position: int) -> tuple[np.ndarray, np.ndarray]:
        """(logits (V,), the next h (C_b,)) of one step: `token` with the state h at query `position`."""
        text, w = self.text, self.w
        e = self.embed_table[token] * np.sqrt(self.cfg["backbone_hidden_size"])
        x = np.concatenate([e, h]) @ w["pre_projection.weight"].T
        H = text["num_attention_heads"]
        for i, kind in enumerate(text["layer_types"]):
            p = f"model.layers.{i}."
            D = text["global_head_dim"] if kind == "full_attention" else text["head_dim"]
            keys, values = kv[kind]  # (KV, n, D)
            a = rms(x, w[p + "input_layernorm.weight"])
            q = rms((a @ w[p + "self_attn.q_proj.weight"].T).reshape(H, 1, D), w[p + "self_attn.q_norm.weight"])
            q = rope(q, np.array([float(position)]), inv_freq(text["rope_parameters"][kind], D))[:, 0]  # (H, D)
            group = H // keys.shape[0]
            heads = []
            for j in range(H):
                scores = keys[j // group] @ q[j]  # softmax scale 1
                weights = np.exp(scores - scores.max())
                heads.append((weights / weights.sum()) @ values[j // group])
            x = x + rms(np.concatenate(heads) @ w[p + "self_attn.o_proj.weight"].T, w[p + "post_attention_layernorm.weight"])
            m = rms(x, w[p + "pre_feedforward_layernorm.weight"])
            m = (gelu_tanh(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
            x = (x + rms(m, w[p + "post_feedforward_layernorm.weight"])) * w[p + "layer_scalar"]
        y = rms(x, w["model.norm.weight"])
        return self.head(y), y @ w["post_projection.weight"].T

    def head(self, y: np.ndarray) -> np.ndarray:
        table = self.w["model.embed_tokens.weight"]
        if not self.cfg["use_ordered_embeddings"]:
            return table @ y
        scores = self.w["masked_embedding.centroids.weight"] @ y
        best = np.argsort(-scores)[: self.cfg["centroid_intermediate_top_k"]]
        ids = self.w["masked_embedding.token_ordering"].reshape(self.cfg["num_centroids"], -1)[best].reshape(-1)
        chosen = table[ids] @ y
        out = np.full(table.shape[0], chosen.min() - 1.0)
        out[ids] = chosen
        return out

    def greedy_chain(self, anchor: int, h: np.ndarray, kv: dict, position: int, n: int) -> tuple[list[int], np.ndarray]:
        """n greedy drafts after `anchor`, and the first step's logits."""
        tokens, token, first = [], anchor, None
        for _ in range(n):
            logits, h = self.step(token, h, kv, position)
            first = logits if first is None else first
            token = int(np.argmax(logits))
            tokens.append(token)
        return tokens, first
