"""The DFlash 2 draft (../shared/DRAFTERS.md section 1; z-lab/dflash `DFlash2DraftModel`): DFlash's block
backbone with a two-sided dynamic grouped causal convolution around each sublayer, and a candidate-path
selector in place of the per-position argmax.

Per layer, with `h = input_layernorm(x)`: `dyn = attention_conv.kernel_projection(h)` viewed (L, 2, K, C/G);
the attention reads `conv(h, base[0] + dyn[0])` (queries and the block's own K/V); its output `a` becomes
`conv(a, base[1] + dyn[1])` (the same dyn, from the sublayer's input) before the residual; likewise around
the MLP with `mlp_conv` on `post_attention_layernorm(x)`. `conv(x, k)[i, c] = sum_t k[i, t, c] * x[i - t, c]`
over the block's rows only (zero before its first row), the dynamic part shared by each group of G channels.
The context K/V are projections of the fused target features, as DFlash's: no conv there.

Selector: `unary = lm_head(o) * output_multiplier` (then an optional tanh softcap), its top-K ids per
position; walking from the anchor, `score(c | prev) = unary[c] + <pred_cb[prev] * hidden_projection(o), succ_cb[c]>`
over the K; greedy takes the argmax, sampled draws from `q = softmax(score / T)` over the K, and `q` (zero
off the K) is the draft distribution the sampled verify's residual uses, so sampling stays lossless.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.models.heads.dspark.dflash2_args import ARCHITECTURE, DFlash2Fields, dflash2_fields  # noqa: F401  (re-exported)
from mlx_dspark.models.heads.dspark.model import DecoderLayer, DSparkDraft
from mlx_dspark.models.heads.proposal import Proposal

class GroupedDynamicCausalConv(nn.Module):
    """`base_kernel` (2, K, C) and `kernel_projection` (C -> 2 K C/G): the two sides of one sublayer's conv."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size), bias=False)

    def dynamic(self, h: mx.array) -> mx.array:
        """(B, L, 2, K, C/G) from the sublayer's normed input."""
        B, L, C = h.shape
        return self.kernel_projection(h).reshape(B, L, 2, self.kernel_size, C // self.group_size)

    def apply(self, x: mx.array, dyn: mx.array, side: int) -> mx.array:
        """sum_t (base[side, t] + dyn[:, :, side, t] per group) * x shifted down t rows (zeros above the block)."""
        B, L, C = x.shape
        groups = C // self.group_size
        out = mx.zeros_like(x)
        for t in range(self.kernel_size):
            shifted = x if t == 0 else mx.concatenate([mx.zeros((B, min(t, L), C), dtype=x.dtype), x[:, : max(L - t, 0)]], axis=1)
            grouped = shifted.reshape(B, L, groups, self.group_size)
            kernel = self.base_kernel[side, t].reshape(groups, self.group_size) + dyn[:, :, side, t][..., None]
            out = out + (kernel.astype(x.dtype) * grouped).reshape(B, L, C)
        return out


class DFlash2Layer(DecoderLayer):
    """DFlash's decoder layer with the convolutions around its attention and MLP."""

    def __init__(self, args: Any, layer: int):
        super().__init__(args, layer)
        fields, hidden = args.dflash2, args.hidden_size
        self.attention_conv = GroupedDynamicCausalConv(hidden, fields.conv_kernel_size, fields.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(hidden, fields.conv_kernel_size, fields.conv_group_size)

    def forward(self, x: mx.array, attend: Callable[[mx.array], mx.array]) -> mx.array:
        """x (B, L, H): the block rows of B sequences; the convolutions run along L, within each block."""
        h = self.input_layernorm(x)
        dyn = self.attention_conv.dynamic(h)
        x = x + self.attention_conv.apply(attend(self.attention_conv.apply(h, dyn, 0)), dyn, 1)
        h = self.post_attention_layernorm(x)
        dyn = self.mlp_conv.dynamic(h)
        return x + self.mlp_conv.apply(self.mlp(self.mlp_conv.apply(h, dyn, 0)), dyn, 1)


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = mx.zeros((vocab, rank))  # stored without `.weight`, as z-lab's checkpoints
        self.successor_codebook = mx.zeros((vocab, rank))


class DFlash2Draft(DSparkDraft):
    whole_head_reason = "a DFlash2 draft's candidate selector reads the target's whole LM head"

    def __init__(self, args: Any):
        super().__init__(args)
        fields = args.dflash2
        self.layers = [DFlash2Layer(args, i) for i in range(args.num_hidden_layers)]
        self.candidate_selector = CandidateSelector(args.hidden_size, args.vocab_size, fields.selector_rank)

    def unary_logits(self, hidden: mx.array, *, target: Any) -> mx.array:
        fields = self.args.dflash2
        logits = target.lm_head_logits(hidden).astype(mx.float32) * fields.output_multiplier
        cap = fields.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap

    def propose_from_block(
        self,
        anchor: mx.array,
        block: mx.array,
        *,
        target: Any,
        greedy: bool,
        temperature: float,
        num_tokens: int,
        logits_hook: Optional[Callable] = None,
    ) -> Proposal:
        first = self.args.packaging.first_draft_row
        hidden = block[:, first : first + num_tokens]  # o(1..n), (B, n, H)
        unary = self.unary_logits(hidden, target=target)  # (B, n, V)
        k = self.args.dflash2.selector_top_k
        selector = self.candidate_selector
        projected = selector.hidden_projection(hidden).astype(mx.float32)  # (B, n, rank)
        prev = anchor.reshape(-1)
        tokens, probs, draws = [], [], []
        for i in range(num_tokens):
            logits = unary[:, i]
            if logits_hook is not None:  # penalties / a grammar's mask, before the candidates are taken
                logits = logits_hook(logits, tokens)
                if logits is None:
                    break
            candidates = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]  # the top-K ids (order irrelevant)
            a = selector.predecessor_codebook[prev].astype(mx.float32) * projected[:, i]  # (B, rank)
            pairwise = (selector.successor_codebook[candidates].astype(mx.float32) @ a[..., None])[..., 0]  # (B, K)
            scores = mx.take_along_axis(logits, candidates, axis=-1) + pairwise
            if greedy:
                pick = mx.argmax(scores, axis=-1)
                q = mx.softmax(scores, axis=-1)
            else:
                q = mx.softmax(scores / temperature, axis=-1)
                pick = mx.random.categorical(scores / temperature, axis=-1)
                draws.append(_scatter(q, candidates, logits.shape[-1]))
            prev = mx.take_along_axis(candidates, pick[:, None], axis=-1)[:, 0]
            tokens.append(prev)
            probs.append(mx.max(q, axis=-1))
        if not tokens:
            empty = mx.zeros((anchor.shape[0], 0), anchor.dtype)  # the hook ended it before its first position
            return Proposal(tokens=empty, draft_probs=None, token_probs=empty.astype(mx.float32), confidence=None)
        return Proposal(
            tokens=mx.stack(tokens, axis=1).astype(anchor.dtype),
            draft_probs=None if greedy else mx.stack(draws, axis=1),
            token_probs=mx.stack(probs, axis=1),
            confidence=None,
        )


def _scatter(q: mx.array, ids: mx.array, vocab: int) -> mx.array:
    """(B, K) probabilities of the ids (B, K) as (B, V) rows, zero elsewhere."""
    B = q.shape[0]
    rows = mx.zeros((B, vocab), dtype=q.dtype)
    return mx.put_along_axis(rows, ids, q, axis=-1)


def draft_class(args: Any) -> type:
    """The draft module a parsed config builds: DFlash 2's where its fields are set, else DSpark's."""
    return DFlash2Draft if getattr(args, "dflash2", None) is not None else DSparkDraft
