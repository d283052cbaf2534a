"""A reduced draft vocabulary (FR-Spec, arXiv 2502.14856): the draft scores only K target token ids.

The draft's LM head (the target's, shared) and its Markov head's output projection `markov_w2` are cut
to the rows of `ids` once, so a draft block's vocabulary-sized work (one LM head product over the block,
one `(r, V)` product per Markov step) shrinks by V / K. Draft tokens stay target ids: index j of the
reduced logits is token `ids[j]`. Verification is untouched (the target scores its full vocabulary),
so the output is unchanged for greedy decoding and, with `scatter` giving the exact distribution a
sampled draft token was drawn from, for speculative sampling too. The ids come from a frequency
ranking (`loading/rank_vocab.py`) or, for drafts packaged with one, a `d2t` map.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.models.target.lm_head import target_head


class RestrictedRows:
    """The rows `ids` of a (V, in) linear map (float or MLX-quantized), applied as x @ W[ids].T."""

    def __init__(self, module: nn.Module, ids: mx.array):
        self.weight = module.weight[ids]  # (K, in) or its packed form
        self.scales = getattr(module, "scales", None)
        self.quantized = self.scales is not None
        if self.quantized:
            self.scales = self.scales[ids]
            biases = getattr(module, "biases", None)
            self.biases = None if biases is None else biases[ids]
            self.group_size, self.bits = module.group_size, module.bits
            self.mode = getattr(module, "mode", "affine")

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.weight, self.scales, getattr(self, "biases", None)) if a is not None]

    def __call__(self, x: mx.array) -> mx.array:
        if not self.quantized:
            return x @ self.weight.T  # as nn.Linear / Embedding.as_linear compute it
        return mx.quantized_matmul(
            x, self.weight, self.scales, self.biases, transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode
        )


class DraftVocabulary:
    """K target token ids the draft proposes from, with the LM head and Markov projection cut to them."""

    def __init__(
        self, ids: Sequence[int], *, target: Any, markov_head: Optional[nn.Module] = None, lm_head: Optional[nn.Module] = None
    ):
        """`lm_head`: a head that already has K outputs (a draft packaged with its own reduced head and a
        `d2t` map); default the target's head cut to `ids`."""
        vocab_size = int(target.args.vocab_size)
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("a draft vocabulary needs at least one token id")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"draft vocabulary ids {bad[:5]} are outside the target's vocabulary [0, {vocab_size})")
        if len(set(ids)) != len(ids):
            raise ValueError("draft vocabulary ids must be distinct")
        self.vocab_size = vocab_size
        self.ids = mx.array(ids, dtype=mx.int32)  # (K,): reduced index -> target id
        self.lm_head = RestrictedRows(target_head(target), self.ids) if lm_head is None else lm_head
        self.markov_w2 = None if markov_head is None else RestrictedRows(markov_head.markov_w2, self.ids)
        head_arrays = self.lm_head.arrays() if isinstance(self.lm_head, RestrictedRows) else []
        mx.eval(self.ids, *head_arrays, *([] if self.markov_w2 is None else self.markov_w2.arrays()))

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def logits(self, hidden: mx.array) -> mx.array:
        """Base logits z(k) over the K ids, (..., K), from final-normed draft rows (..., H)."""
        return self.lm_head(hidden)

    def markov_bias(self, features: mx.array) -> mx.array:
        """The Markov head's bias over the K ids from its rank-space output (..., r)."""
        assert self.markov_w2 is not None, "this vocabulary was built without the draft's Markov head"
        return self.markov_w2(features)

    def to_target(self, index: mx.array) -> mx.array:
        """Reduced indices -> target token ids (same shape)."""
        return self.ids[index]

    def scatter(self, probs: mx.array) -> mx.array:
        """A distribution over the K ids (..., K) as one over the full vocabulary (..., V): zero elsewhere."""
        full = mx.zeros((*probs.shape[:-1], self.vocab_size), dtype=probs.dtype)
        full[..., self.ids] = probs
        return full
