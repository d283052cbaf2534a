"""A target split over the ranks of an `mx.distributed` group (`mlx.launch`), tensor parallel with
mlx-lm's own `Model.shard(group)`: every rank holds a slice of each layer, and the all_sum inside the
sharded projections leaves the whole hidden state on every rank, so the taps, the logits and the draft
inputs exist on every rank.

The round runs on rank 0 only: it proposes (the draft runs there alone), verifies, accepts and rolls
back as on one machine. The other ranks follow its target forwards: before each one rank 0 sends
(which of its caches, the position it starts at, the tokens), two small all_sums, and a follower rolls
its copy of that cache back to the position and runs the same forward, so every collective inside the
layers pairs up. Whatever rank 0 decides (draft lengths from its measured costs, lookup, sampling)
reaches the others as tokens and positions: the ranks cannot disagree. A follower rolls back with the
same exact rollback as rank 0 (`trim_caches`), right after the forward it follows, as rank 0 does.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import mlx.core as mx

from mlx_dspark.models.cache import trim_caches

STOP = -1  # the header rank 0 sends when it is done: followers return
_FOLLOWER_CACHES = 4  # caches a follower keeps (rank 0's generation cache, the cost probe's, ...)


class SplitTargetError(ValueError):
    """A target that cannot be split over this group, said in one line."""


def shard_target(target: Any, group: Any) -> None:
    """Split `target` in place over `group` with mlx-lm's `shard`; a family without one, or a width the
    group does not divide, is refused by name."""
    size = group.size()
    family = getattr(target, "mlx_lm_model_type", None) or type(target).__name__
    shard = getattr(target, "shard", None)
    if shard is None or getattr(target, "mlx_lm_model_type", None) is None:
        raise SplitTargetError(
            f"the target ({family}) cannot be split over {size} ranks: only mlx-lm model classes with a `shard` method "
            "(llama, qwen2, qwen3_5, deepseek_v3, glm4_moe, gpt_oss, ...) are split tensor-parallel"
        )
    args = target.args
    widths = {"num_attention_heads": getattr(args, "num_attention_heads", None),
              "num_key_value_heads": getattr(args, "num_key_value_heads", None),
              "intermediate_size": getattr(args, "intermediate_size", None)}  # fmt: skip
    for name, value in widths.items():
        if isinstance(value, int) and value % size:
            raise SplitTargetError(f"the target's {name} ({value}) is not divisible by the {size} ranks: "
                                   f"run on a number of ranks that divides it")
    shard(group)


def _position(cache: Any) -> int:
    offsets = [getattr(c, "offset", None) for c in cache]
    offsets = [o for o in offsets if isinstance(o, int)]
    if not offsets:
        raise SplitTargetError("a split target needs caches that count their positions (attention caches)")
    return max(offsets)


class LeaderTarget:
    """Mixin put before rank 0's target class (`lead`): each forward is announced to the followers first."""

    def _announce(self, header: list[int], tokens: Optional[mx.array]) -> None:
        group = self._split_group
        mx.eval(mx.distributed.all_sum(mx.array(header, dtype=mx.int32), group=group))
        if tokens is not None:
            mx.eval(mx.distributed.all_sum(tokens.astype(mx.int32), group=group))

    def __call__(self, inputs: mx.array, cache: Optional[list[Any]] = None, **kwargs: Any):
        if cache is None:
            raise SplitTargetError("a split target runs with caches (every forward of the engine has one)")
        position = _position(cache)
        key = self._split_keys.get(id(cache))
        if key is None or position == 0:  # a cache starting afresh is a new one for the followers too
            self._split_count += 1
            key = self._split_keys[id(cache)] = self._split_count
        self._announce([key, position, int(inputs.shape[1])], inputs.reshape(-1))
        return super().__call__(inputs, cache=cache, **kwargs)

    def release_followers(self) -> None:
        """The last announcement: the followers return (call it once rank 0 is done, error or not)."""
        self._announce([STOP, 0, 0], None)


def lead(target: Any, group: Any) -> Any:
    """Make rank 0's `target` announce its forwards to the followers of `group` (in place; returns it)."""
    cls = type(target)
    target.__class__ = type(f"Leading{cls.__name__}", (LeaderTarget, cls), {})
    target._split_group = group
    target._split_keys = {}
    target._split_count = 0
    return target


def follow(target: Any, group: Any, *, max_rollback: int = 32) -> int:
    """Run the forwards rank 0 announces until it says STOP; returns how many were run."""
    caches: OrderedDict[int, Any] = OrderedDict()
    forwards = 0
    while True:
        header = mx.distributed.all_sum(mx.zeros((3,), dtype=mx.int32), group=group)
        key, position, length = (int(v) for v in header.tolist())
        if key == STOP:
            return forwards
        tokens = mx.distributed.all_sum(mx.zeros((length,), dtype=mx.int32), group=group)
        cache = caches.pop(key, None)
        if cache is None:
            cache = target.make_cache(max_rollback=max_rollback)
        caches[key] = cache
        while len(caches) > _FOLLOWER_CACHES:
            caches.popitem(last=False)
        offset = _position(cache) if any(isinstance(getattr(c, "offset", None), int) for c in cache) else 0
        if position > offset:
            raise SplitTargetError(f"rank 0 ran a forward at position {position}, this rank's cache holds {offset}")
        if offset > position:
            trim_caches(cache, offset - position)
        logits, _ = target(tokens.reshape(1, length), cache=cache, last_only=True)
        mx.eval(logits)
        forwards += 1
