"""An independent NumPy restatement of the DFlash 2 draft (z-lab `DFlash2DraftModel`; ../shared/DRAFTERS.md
section 1), over tests/dspark_reference.py's DFlash backbone: per layer `h = in_ln(x)`, dyn from h,
attention on conv(h, base[0] + dyn[0]), its output through conv(., base[1] + dyn[1]); the same around
the MLP; the candidate selector's walk over the top-K of the (scaled, capped) target-head logits."""

from __future__ import annotations

import numpy as np

from tests.dspark_reference import ReferenceDraft, rms_norm


def conv(x: np.ndarray, dyn: np.ndarray, base: np.ndarray, group: int) -> np.ndarray:
    """x (L, C); dyn (L, K, C/G); base (K, C): out[i, c] = sum_t (base[t, c] + dyn[i, t, c // G]) x[i - t, c]."""
    L, C = x.shape
    out = np.zeros_like(x)
    for i in range(L):
        for t in range(base.shape[0]):
            if i - t >= 0:
                out[i] += (base[t] + np.repeat(dyn[i, t], group)) * x[i - t]
    return out


class DFlash2Reference(ReferenceDraft):
    def __init__(self, config: dict, weights: dict[str, np.ndarray]):
        super().__init__(config, weights)
        d = config["dflash_config"]
        self.kernel, self.group = d["conv_kernel_size"], d["conv_group_size"]
        self.top_k, self.scale, self.cap = d["selector_top_k"], d.get("output_multiplier", 1.0), d.get("final_logit_softcapping")
        self.embedding_scale = d.get("input_embedding_scale", config.get("input_embedding_scale", 1.0))  # every block row

    def _sublayer(self, x: np.ndarray, name: str, run) -> np.ndarray:
        w = self.w
        dyn = (x @ w[f"{name}.kernel_projection.weight"].T).reshape(x.shape[0], 2, self.kernel, -1)
        inner = run(conv(x, dyn[:, 0], w[f"{name}.base_kernel"][0], self.group))
        return conv(inner, dyn[:, 1], w[f"{name}.base_kernel"][1], self.group)

    def block_outputs(self, features: np.ndarray, anchor: int, embedding: np.ndarray) -> np.ndarray:
        w = self.w
        p = features.shape[0]
        ctx = rms_norm(np.asarray(features, np.float64) @ w["fc.weight"].T, w["hidden_norm.weight"], self.eps)
        h = np.asarray(embedding, np.float64)[[anchor] + [self.c["mask_token_id"]] * (self.c["block_size"] - 1)] * self.embedding_scale
        for i in range(self.c["num_hidden_layers"]):
            pre = f"layers.{i}."
            normed = rms_norm(h, w[pre + "input_layernorm.weight"], self.eps)
            h = h + self._sublayer(normed, pre + "attention_conv", lambda a: self._attention(i, a, ctx, p))
            normed = rms_norm(h, w[pre + "post_attention_layernorm.weight"], self.eps)
            h = h + self._sublayer(normed, pre + "mlp_conv", lambda m: self._mlp(i, m))
        return rms_norm(h, w["norm.weight"], self.eps)

    def select(self, features: np.ndarray, anchor: int, *, embedding: np.ndarray, lm_head: np.ndarray, n: int) -> dict:
        """Greedy path and, per position, the K candidates and their scores (the selector's q is softmax of them)."""
        w = self.w
        o = self.block_outputs(features, anchor, embedding)[1 : 1 + n]  # a z-lab draft drafts from row 1
        unary = (o @ np.asarray(lm_head, np.float64).T) * self.scale
        if self.cap:
            unary = np.tanh(unary / self.cap) * self.cap
        projected = o @ w["candidate_selector.hidden_projection.weight"].T
        prev, path, cands, scores = anchor, [], [], []
        for i in range(n):
            top = np.argsort(-unary[i], kind="stable")[: self.top_k]
            s = unary[i, top] + w["candidate_selector.successor_codebook"][top] @ (w["candidate_selector.predecessor_codebook"][prev] * projected[i])
            prev = int(top[np.argmax(s)])
            path.append(prev)
            cands.append(top)
            scores.append(s)
        return {"tokens": path, "candidates": cands, "scores": scores}
