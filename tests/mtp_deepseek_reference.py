"""An independent NumPy restatement of DeepSeek-V3's / GLM-4.5's next-n MTP step, read straight from the HF safetensors.

Written from the published math (DRAFTERS.md section 2; vLLM `deepseek_mtp.py` / `glm4_moe_mtp.py`,
`deepseek_v2.py` / `glm4_moe.py`; transformers' DeepSeek-V3 / GLM-4-MoE modelling): the next-n layer at
`model.layers.<num_hidden_layers + i>` reads e = embed(token_{t+1}) (zero at position 0) and the target's
final normed state h_t, x = eh_proj([enorm(e), hnorm(h_t)]), runs its decoder block (pre-norm residual
attention + MoE), and its logits are shared_head.head(shared_head.norm(out)). The block is restated too:
DeepSeek's MLA (low-rank q with its norm, or one q_proj when q_lora_rank is null, the compressed KV latent with its norm, kv_b_proj expanding it
per head, interleaved RoPE on the decoupled rope dims, scale (nope + rope)^-1/2) or GLM's GQA (biased
q/k/v, per-head q/k RMSNorms when use_qk_norm, neox RoPE on the first partial_rotary_factor of each head); the MoE router (sigmoid scores, the
correction bias for the choice only, groups ranked by their top-2 sum, the best topk_group kept, top-k
experts, weights normalised and scaled by routed_scaling_factor) over SwiGLU experts plus the shared
expert. A chain feeds the block's pre-norm output back as the next hidden state; step k uses layer
k mod n. An FP8 checkpoint's matrices are decoded here (e4m3 bytes times their 128 x 128 block's
weight_scale_inv). Nothing here imports mlx_dspark or mlx-lm modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def e4m3(data: np.ndarray) -> np.ndarray:
    """FP8 E4M3 (OCP 'fn': bias 7, no infinities, 0x7F / 0xFF NaN) bytes -> their values."""
    b = data.astype(np.int64)
    sign, exponent, mantissa = b >> 7, (b >> 3) & 0xF, b & 0x7
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6, (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    value = np.where((exponent == 15) & (mantissa == 7), np.nan, value)
    return np.where(sign == 1, -value, value)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class NextNReference:
    def __init__(self, path: str | Path):
        path = Path(path)
        raw = {}
        for file in sorted(path.glob("*.safetensors")):
            raw.update(load_file(str(file)))
        for name in [k for k in raw if k.endswith(".weight_scale_inv")]:  # an FP8 matrix: e4m3 bytes x its block scale
            weight = name.removesuffix("_scale_inv")
            scale = np.repeat(np.repeat(raw.pop(name).astype(np.float64), 128, axis=0), 128, axis=1)
            rows, cols = raw[weight].shape
            raw[weight] = e4m3(raw[weight]) * scale[:rows, :cols]
        self.w = {k: v.astype(np.float64) for k, v in raw.items()}
        self.c = c = json.loads((path / "config.json").read_text())
        self.kind, self.eps, self.heads = c["model_type"], c["rms_norm_eps"], c["num_attention_heads"]
        self.first, self.n = c["num_hidden_layers"], c["num_nextn_predict_layers"]

    def layer(self, step: int) -> str:
        return f"model.layers.{self.first + step % self.n}"

    def get(self, name: str, fallback: str) -> np.ndarray:
        return self.w[name] if name in self.w else self.w[fallback]

    def norm(self, x: np.ndarray, name: str, eps: float | None = None) -> np.ndarray:
        eps = self.eps if eps is None else eps
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * self.w[name]

    def rope(self, x: np.ndarray, positions: np.ndarray, dims: int, *, interleaved: bool) -> np.ndarray:
        """x (n, ..., D): the first `dims` features rotated; interleaved pairs (2i, 2i+1), else halves."""
        inv = self.c["rope_theta"] ** (-np.arange(0, dims, 2) / dims)
        ang = positions[:, None] * inv[None]  # (n, dims / 2)
        shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (dims // 2,)
        cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
        if interleaved:
            a, b = x[..., 0:dims:2], x[..., 1:dims:2]
            rotated = np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(*x.shape[:-1], dims)
        else:
            a, b = x[..., : dims // 2], x[..., dims // 2 : dims]
            rotated = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
        return np.concatenate([rotated, x[..., dims:]], axis=-1)

    @staticmethod
    def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
        """q, k (n, H, Dk), v (n, H, Dv), causal -> (n, H * Dv)."""
        n = q.shape[0]
        scores = np.einsum("ihd,jhd->hij", q, k) * scale
        scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        return np.einsum("hij,jhd->ihd", probs, v).reshape(n, -1)

    def mla(self, x: np.ndarray, positions: np.ndarray, p: str) -> np.ndarray:
        c, w, H = self.c, self.w, self.heads
        nope, rope, vd, r = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        if c.get("q_lora_rank") is None:  # no low-rank query: one q_proj
            q = (x @ w[f"{p}.q_proj.weight"].T).reshape(-1, H, nope + rope)
        else:
            q = (self.norm(x @ w[f"{p}.q_a_proj.weight"].T, f"{p}.q_a_layernorm.weight") @ w[f"{p}.q_b_proj.weight"].T).reshape(-1, H, nope + rope)
        ckv = x @ w[f"{p}.kv_a_proj_with_mqa.weight"].T  # (n, r + rope)
        kv = (self.norm(ckv[:, :r], f"{p}.kv_a_layernorm.weight") @ w[f"{p}.kv_b_proj.weight"].T).reshape(-1, H, nope + vd)
        k_pe = np.repeat(self.rope(ckv[:, None, r:], positions, rope, interleaved=True), H, axis=1)  # one rope key for all heads
        q = np.concatenate([q[..., :nope], self.rope(q[..., nope:], positions, rope, interleaved=True)], axis=-1)
        k = np.concatenate([kv[..., :nope], k_pe], axis=-1)
        return self.attend(q, k, kv[..., nope:], (nope + rope) ** -0.5) @ w[f"{p}.o_proj.weight"].T

    def gqa(self, x: np.ndarray, positions: np.ndarray, p: str) -> np.ndarray:
        c, w, H = self.c, self.w, self.heads
        D, KV = c["head_dim"], c["num_key_value_heads"]
        q, k, v = ((x @ w[f"{p}.{n}_proj.weight"].T + w.get(f"{p}.{n}_proj.bias", 0.0)).reshape(len(x), -1, D) for n in "qkv")
        if c.get("use_qk_norm"):  # per-head RMSNorms of q and k, before RoPE
            q, k = self.norm(q, f"{p}.q_norm.weight"), self.norm(k, f"{p}.k_norm.weight")
        dims = int(D * c["partial_rotary_factor"])
        q, k = (self.rope(t, positions, dims, interleaved=False) for t in (q, k))
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        return self.attend(q, k, v, D**-0.5) @ w[f"{p}.o_proj.weight"].T

    def swiglu(self, x: np.ndarray, p: str) -> np.ndarray:
        w = self.w
        return (_silu(x @ w[f"{p}.gate_proj.weight"].T) * (x @ w[f"{p}.up_proj.weight"].T)) @ w[f"{p}.down_proj.weight"].T

    def moe(self, x: np.ndarray, p: str) -> np.ndarray:
        c = self.c
        E, G = c["n_routed_experts"], c["n_group"]
        scores = 1.0 / (1.0 + np.exp(-(x @ self.w[f"{p}.gate.weight"].T)))  # (n, E)
        choice = scores + self.w[f"{p}.gate.e_score_correction_bias"]
        groups = np.sort(choice.reshape(len(x), G, E // G), axis=-1)[..., -2:].sum(-1)  # (n, G)
        kept = np.argsort(-groups, axis=-1)[:, : c["topk_group"]]
        mask = np.zeros((len(x), G), bool)
        np.put_along_axis(mask, kept, True, axis=-1)
        choice = np.where(np.repeat(mask, E // G, axis=-1), choice, 0.0)
        top = np.argsort(-choice, axis=-1)[:, : c["num_experts_per_tok"]]
        weights = np.take_along_axis(scores, top, axis=-1)
        if c["norm_topk_prob"]:
            weights = weights / weights.sum(-1, keepdims=True)
        weights = weights * c["routed_scaling_factor"]
        out = self.swiglu(x, f"{p}.shared_experts")
        for i in range(len(x)):
            for e, g in zip(top[i], weights[i]):
                out[i] += g * self.swiglu(x[i : i + 1], f"{p}.experts.{e}")[0]
        return out

    def block(self, x: np.ndarray, p: str) -> np.ndarray:
        """The decoder block over rows at positions 0 .. n-1 (causal) -> pre-norm outputs (n, C)."""
        positions = np.arange(len(x), dtype=np.float64)
        attention = self.mla if self.kind == "deepseek_v3" else self.gqa
        h = x + attention(self.norm(x, f"{p}.input_layernorm.weight"), positions, f"{p}.self_attn")
        normed = self.norm(h, f"{p}.post_attention_layernorm.weight")
        mlp = self.moe if f"{p}.mlp.gate.weight" in self.w else self.swiglu
        return h + mlp(normed, f"{p}.mlp")

    def inputs(self, tokens: list[int], hidden: np.ndarray, step: int, first_position: int) -> np.ndarray:
        """eh_proj rows for (token_{t+1}, h_t) pairs whose positions start at `first_position`."""
        p = self.layer(step)
        embed = self.get(f"model.layers.{self.first}.embed_tokens.weight", "model.embed_tokens.weight")[tokens]
        if first_position == 0:
            embed[0] = 0.0
        x = np.concatenate([self.norm(embed, f"{p}.enorm.weight"), self.norm(hidden, f"{p}.hnorm.weight")], axis=-1)
        return x @ self.w[f"{p}.eh_proj.weight"].T

    def logits(self, out: np.ndarray, step: int) -> np.ndarray:
        p = self.layer(step)
        head = self.get(f"{p}.shared_head.head.weight", "lm_head.weight")
        return self.norm(out, f"{p}.shared_head.norm.weight") @ head.T

    def step_logits(self, tokens: list[int], hidden: np.ndarray, step: int = 0) -> np.ndarray:
        """One step of layer `step` mod n over entries 0 .. n-1 (its own cache empty before) -> (n, V)."""
        x = self.inputs(tokens, hidden, step, 0)
        return self.logits(self.block(x, self.layer(step)), step)

    def greedy_chain(self, tokens: list[int], hidden: np.ndarray, k: int) -> list[int]:
        """k greedy drafts: the committed entries (token t+1, h_t), then k - 1 chained entries, each the
        previous step's pre-norm output beside its draft's embedding (one layer: n is 1)."""
        assert self.n == 1
        p = self.layer(0)
        rows = self.inputs(tokens, hidden, 0, 0)
        drafts = []
        for _ in range(k):
            out = self.block(rows, p)
            drafts.append(int(np.argmax(self.logits(out[-1:], 0)[0])))
            rows = np.concatenate([rows, self.inputs([drafts[-1]], out[-1:], 0, len(rows))])
        return drafts
