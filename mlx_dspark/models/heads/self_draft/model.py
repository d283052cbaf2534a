"""The target's early exit as a draft: its first `num_layers` decoder layers, then its own final norm and head.

Nothing is copied: `exit_logits` runs the target's own forward (mlx-lm's `__call__`, through the target adapter
in models/target/mlx_lm.py) with its decoder layer list cut to the first `num_layers`, so the embedding, the
masks, the norm after the layers and mlx-lm's head code (tied or not, softcap, logit scale) are the family's
own. Over the target's caches the cut forward appends to the caches of layers 0 .. N - 1 only; the proposer
rolls them back (engine/proposers/self_draft.py).

`check_exit` proves the cut on a probe, once per target: each of the first N layers called once and no other,
and the cut forward's layer N - 1 output equal to the full forward's. A family whose backbone does more after
its layer loop than the final norm, or reads layers past the cut, fails it and is refused by model_type.

`choose_layers` is `self` without an N: it measures, on the target's own greedy text, how often the exit at a
few depths predicts the target's next token, prices each depth by the bytes a decode step reads (a step is
memory-bound on Apple silicon: layers 0 .. N - 1 and the head, against every layer and the head) and takes the
depth of the best ideal rate. Whether drafting pays at all is then the `auto` length's call (it parks).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_dspark.models.caches.rollback import layer_owner

SELF_DRAFT = "self"  # the `draft=` / `--draft` name; "self:N" drafts with the first N layers
FRACTIONS = (0.25, 0.375, 0.5, 0.625, 0.75)  # the depths `choose_layers` tries, as fractions of the target's layers
PROBE_SEED, PROBE_TOKENS = 6, 32  # the probe text: the target's greedy continuation of a fixed seed
MAX_DRAFTS = 8  # the longest proposal the choice prices


class SelfDraft(nn.Module):
    """The early-exit head of `load(target, draft="self")`; `num_layers` None: chosen at first use (`layers_for`)."""

    def __init__(self, num_layers: Optional[int] = None):
        super().__init__()
        self.requested = num_layers
        self.choice: Optional["LayerChoice"] = None  # what `choose_layers` measured, once per loaded pair
        self.checked: set[int] = set()  # depths whose cut `check_exit` proved on this pair's target

    def layers_for(self, target: Any) -> int:
        """The number of target layers the draft runs: the requested N (checked against the target), else chosen."""
        total = target.args.num_hidden_layers
        if self.requested is not None:
            check_num_layers(self.requested, total)
            if self.requested not in self.checked:
                check_exit(target, self.requested)
                self.checked.add(self.requested)
            return self.requested
        if self.choice is None:
            self.choice = choose_layers(target)
        return self.choice.num_layers


def check_num_layers(num_layers: int, total: int, *, source: str = "draft") -> None:
    if not 1 <= num_layers <= total - 1:
        raise ValueError(f"{source}: self:{num_layers} is out of range: this target has {total} layers, give N in 1..{total - 1}")


@contextmanager
def early_exit(target: Any, num_layers: int) -> Iterator[None]:
    """Within it, the target's forward runs its first `num_layers` layers, then its final norm and head."""
    owner = layer_owner(target)
    layers = owner["layers"]
    owner["layers"] = layers[:num_layers]
    try:
        yield
    finally:
        owner["layers"] = layers


def exit_logits(target: Any, tokens: mx.array, cache: Any, num_layers: int) -> mx.array:
    """Logits (1, L, V) of the exit after `num_layers` layers for `tokens` (1, L), appending to `cache`'s layers
    0 .. num_layers - 1 (the others are not touched)."""
    with early_exit(target, num_layers):
        logits, _ = target(tokens, cache=cache)
    return logits


def _probe_ids(target: Any, length: int) -> mx.array:
    vocab = target.args.vocab_size
    return mx.array([[(7 + 31 * i) % vocab for i in range(length)]], dtype=mx.int32)


def check_exit(target: Any, num_layers: int) -> None:
    """ValueError naming the model_type when the cut forward's layer N - 1 is not the full forward's."""
    if target.pipelined:
        raise ValueError("draft 'self' runs the target's first layers on one machine; a target split over ranks cannot")
    ids, tap = _probe_ids(target, PROBE_SEED), (num_layers - 1,)
    # over caches, as the draft runs (a family may read a cache of a layer past the cut, e.g. for its masks)
    _, full = target(ids, cache=target.make_cache(), tap_ids=tap)
    cache = target.make_cache()  # made outside the cut: a family's make_cache reads its layer list
    try:
        with early_exit(target, num_layers):
            _, cut = target(ids, cache=cache, tap_ids=tap)
        same = mx.array_equal(full, cut).item()
    except (ValueError, IndexError, KeyError, TypeError) as e:  # mlx-lm's code reading layers past the cut
        same = f"its forward fails when cut ({type(e).__name__}: {e})"
    if same is not True:
        why = same or f"layer {num_layers - 1}'s output differs from the full forward's"
        raise ValueError(f"model_type {target.mlx_lm_model_type!r}: draft 'self' cannot cut this model's forward after "
                         f"{num_layers} layers ({why}); use another draft")  # fmt: skip


@dataclass(frozen=True)
class LayerChoice:
    """What `choose_layers` measured: per depth N, the exit's agreement with the target and its step cost."""

    num_layers: int
    agreement: dict[int, float]  # N -> share of probe positions where the exit's argmax is the target's
    step_cost: dict[int, float]  # N -> bytes of one exit step / bytes of one target step
    rate: dict[int, float]  # N -> best ideal tokens per target step over 1..MAX_DRAFTS drafts (verify = one step)

    @property
    def pays(self) -> bool:
        """Whether the chosen depth beats plain decoding even where a verify costs one step (else `auto` parks)."""
        return self.rate[self.num_layers] > 1.0


def step_cost(target: Any, num_layers: int) -> float:
    """Bytes an exit step after `num_layers` layers reads over a full step's: its layers and the head, against
    every layer and the head (an embedding row and the norms are next to nothing)."""
    layers = layer_owner(target)["layers"]
    size = [sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in layers]
    head_module = target.output_head if target.output_head is not None else target.embedding
    head = sum(v.nbytes for _, v in tree_flatten(head_module.parameters()))
    return (sum(size[:num_layers]) + head) / (sum(size) + head)


def ideal_rate(agreement: float, cost: float) -> float:
    """Tokens per target step of the best fixed length of 1 or more, each draft accepted with chance `agreement`."""
    best, expected = 0.0, 1.0
    for k in range(1, MAX_DRAFTS + 1):
        expected += agreement**k
        best = max(best, expected / (1.0 + k * cost))
    return best


def choose_layers(target: Any) -> LayerChoice:
    """The depth whose exit drafts best for `target` on its own greedy text (see the module docstring)."""
    total = target.args.num_hidden_layers
    if total < 2:
        raise ValueError(f"draft 'self' needs a target of 2 or more layers; model_type {target.mlx_lm_model_type!r} has {total}")
    depths = sorted({min(total - 1, max(1, round(total * f))) for f in FRACTIONS})
    for n in depths:
        check_exit(target, n)
    tokens = _greedy_text(target, _probe_ids(target, PROBE_SEED), PROBE_TOKENS)  # (1, seed + PROBE_TOKENS)
    following = tokens[0, PROBE_SEED:]
    agreement, cost, rate = {}, {}, {}
    for n in depths:
        cache = target.make_cache()
        with early_exit(target, n):
            logits, _ = target(tokens[:, :-1], cache=cache)
        guesses = mx.argmax(logits[0, PROBE_SEED - 1 :], axis=-1)
        agreement[n] = mx.mean(guesses == following).item()
        cost[n] = step_cost(target, n)
        rate[n] = ideal_rate(agreement[n], cost[n])
    best = max(depths, key=lambda n: (rate[n], -n))
    return LayerChoice(best, agreement, cost, rate)


def _greedy_text(target: Any, seed: mx.array, count: int) -> mx.array:
    """`seed` (1, S) followed by the target's `count` greedy tokens: plain decoding over fresh caches."""
    cache = target.make_cache()
    logits, _ = target(seed, cache=cache)
    out = [seed]
    for _ in range(count):
        token = mx.argmax(logits[:, -1], axis=-1)[None].astype(mx.int32)  # (1, 1)
        out.append(token)
        logits, _ = target(token, cache=cache)
    return mx.concatenate(out, axis=1)
