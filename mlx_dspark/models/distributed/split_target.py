"""A target split over the ranks of an `mx.distributed` group (`mlx.launch`) with mlx-lm's own methods:

- tensor parallel, `Model.shard(group)`: every rank holds a slice of each layer, and the all_sum inside
  the sharded projections leaves the whole hidden state on every rank, so the taps exist on every rank.
  A family whose `shard` also splits the LM head over the vocabulary (qwen3_5) keeps the whole head on
  rank 0 for the draft, which reads it alone (the target's own forward uses the sharded one);
- pipeline parallel, `model.model.pipeline(group)`: rank r holds a run of layers (rank 0 the last ones);
  the hidden state goes rank to rank and the final one is all-gathered, so logits exist on every rank but
  a tap lives on the rank that owns its layer. After each forward every rank adds the taps it owns into
  one all_sum (zeros elsewhere: the sum is exact), so the draft on rank 0 has them all.

The round runs on rank 0 only: it proposes (the draft runs there alone), verifies, accepts and rolls
back as on one machine. The other ranks follow its target forwards: before each one rank 0 sends
(which of its caches, the position it starts at, the tokens, the taps it reads), two small all_sums,
and a follower rolls its copy of that cache back to the position and runs the same forward, so every
collective inside the layers pairs up. Whatever rank 0 decides (draft lengths from its measured costs,
lookup, sampling) reaches the others as tokens and positions: the ranks cannot disagree. A follower rolls
back with the same exact rollback as rank 0 (`trim_caches`), right before the next forward it follows.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

import mlx.core as mx

from mlx_dspark.models.layers.base import FINAL_TAP
from mlx_dspark.models.caches.kv import trim_caches

STOP = -1  # the header rank 0 sends when it is done: followers return
TENSOR, PIPELINE = "tensor", "pipeline"
LINK_ERRORS = ("[ring]", "[jaccl]", "[mpi]")  # MLX's backends name themselves in a failed collective's error
_FOLLOWER_CACHES = 4  # caches a follower keeps (rank 0's generation cache, the cost probe's, ...)
_HEAD_WIDTHS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "linear_num_key_heads", "linear_num_value_heads")


class SplitTargetError(ValueError):
    """A target that cannot be split over this group, said in one line."""


def agree(group: Any, parts: dict[str, bytes], *, what: str) -> None:
    """Every rank holds the same `parts` (name -> a 32-byte digest, the same names in the same order on
    every rank), else SplitTargetError naming the ranks and parts that differ. One all_gather."""
    words = mx.array([list(digest[:32]) for digest in parts.values()], dtype=mx.uint8).reshape(-1)
    gathered = mx.distributed.all_gather(words.astype(mx.int32), group=group).reshape(group.size(), len(parts), 32)
    mine = gathered[group.rank()]
    differ = {}
    for rank in range(group.size()):
        names = [name for i, name in enumerate(parts) if not mx.array_equal(gathered[rank, i], mine[i]).item()]
        if names:
            differ[rank] = names
    if differ:
        told = "; ".join(f"rank {r}: {', '.join(names)}" for r, names in sorted(differ.items()))
        raise SplitTargetError(f"the ranks did not load the same {what}: differ from this rank's ({told}); give every "
                               "rank the same files at the same path and the same package versions")


def split_modes(target: Any) -> tuple[str, ...]:
    """The ways mlx-lm's class of `target` can be split: TENSOR (`shard`), PIPELINE (`model.pipeline`)."""
    if getattr(target, "mlx_lm_model_type", None) is None:
        return ()
    modes = (TENSOR,) if callable(getattr(target, "shard", None)) else ()
    backbone = getattr(target, "model", None)
    return modes + ((PIPELINE,) if callable(getattr(backbone, "pipeline", None)) else ())


def split_target(target: Any, group: Any, *, mode: Optional[str] = None) -> str:
    """Split `target` in place over `group`: `mode` TENSOR or PIPELINE, None for tensor parallel where
    the class has `shard`, else pipeline parallel. A family with neither, a mode its class lacks, or
    widths the group does not divide are refused by name. Returns the mode used."""
    size = group.size()
    family = getattr(target, "mlx_lm_model_type", None) or type(target).__name__
    modes = split_modes(target)
    if not modes:
        raise SplitTargetError(
            f"the target ({family}) cannot be split over {size} ranks: only mlx-lm model classes with a `shard` "
            "method (tensor parallel: llama, qwen2, qwen3_5, deepseek_v3, glm4_moe, gpt_oss, ...) or a `pipeline` "
            "method (pipeline parallel: qwen3_5, deepseek_v3, glm4_moe, ministral3) are split"
        )
    mode = mode or modes[0]
    if mode not in modes:
        raise SplitTargetError(f"the target ({family}) cannot be split {mode}-parallel over {size} ranks: mlx-lm's class "
                               f"implements {' and '.join(m + '-parallel' for m in modes)} only")
    if mode == TENSOR:
        _shard(target, group, family)
    else:
        _pipeline(target, group, family)
    return mode


def _text_args(target: Any) -> Any:
    """The args holding the layer widths (a multimodal wrapper's language model's)."""
    found = [target.args] + [getattr(m, "args", None) for _, m in target.named_modules()]
    return next((a for a in found if getattr(a, "num_attention_heads", None) is not None), target.args)


def _shard(target: Any, group: Any, family: str) -> None:
    size = group.size()
    args = _text_args(target)
    for name in _HEAD_WIDTHS:
        value = getattr(args, name, None)
        if isinstance(value, int) and value % size and not (name == "num_key_value_heads" and family == "qwen3_5"):
            raise SplitTargetError(f"the target's {name} ({value}) is not divisible by the {size} ranks: "
                                   f"run on a number of ranks that divides it")
    whole_head = target.output_head
    try:
        target.shard(group)
    except AssertionError as err:  # mlx-lm's own checks (a vocabulary the ranks do not divide, ...)
        raise SplitTargetError(f"the target ({family}) cannot be split tensor-parallel over {size} ranks: {err}") from None
    if whole_head is not None and target.output_head is not whole_head:  # the head is split over the vocabulary
        if target.head_is_models_own:
            raise SplitTargetError(f"the target ({family}) cannot be split tensor-parallel: its head is split over the "
                                   "ranks and is not a plain product the draft could read whole on rank 0")
        if group.rank() == 0:  # the draft's head, outside the parameter tree
            object.__setattr__(target, "_whole_head", whole_head)


def _pipeline(target: Any, group: Any, family: str) -> None:
    size, layers = group.size(), target.args.num_hidden_layers
    if layers < size:
        raise SplitTargetError(f"the target ({family}) has {layers} layers: it cannot be split pipeline-parallel over "
                               f"{size} ranks; run on at most {layers} ranks")
    target.model.pipeline(group)
    target._capture.cut_at_last_layer = False
    cls = type(target)
    target.__class__ = type(f"Pipelined{cls.__name__}", (PipelineStage, cls), {"__module__": __name__})
    target._split_group = group


class PipelineStage:
    """Mixin put before a pipelined target's class: the taps of other ranks' layers reach every rank."""

    pipelined = True

    def _complete_taps(self, logits: mx.array, taps: dict[int, mx.array], tap_ids: tuple[int, ...]) -> dict[int, mx.array]:
        layer_ids = [i for i in tap_ids if i != FINAL_TAP]  # the final state is on every rank already
        final = self._capture.final  # (B, L, H) on every rank: all-gathered
        # The forward first (its send / recv / all_gather), the taps' all_sum after: every rank runs its
        # collectives in one order, whatever its graph looks like.
        mx.eval(logits, final, *[taps[i] for i in layer_ids if i in taps])
        if not layer_ids:
            return taps
        own = [taps[i].astype(final.dtype) if i in taps else mx.zeros(final.shape, dtype=final.dtype) for i in layer_ids]
        summed = mx.distributed.all_sum(mx.stack(own), group=self._split_group)  # (T, B, L, H)
        mx.eval(summed)
        return {**taps, **{i: summed[n] for n, i in enumerate(layer_ids)}}


def _position(cache: Any) -> int:
    offsets = [getattr(c, "offset", None) for c in cache]
    offsets = [o for o in offsets if isinstance(o, int)]
    if not offsets:
        raise SplitTargetError("a split target needs caches that count their positions (attention caches)")
    return max(offsets)


def _evaluated(arrays: list[Any], on_lost: Optional[Callable[[str], None]], *, doing: str) -> None:
    """`mx.eval(*arrays)`, their collectives included; a link to another rank lost on the way goes to `on_lost`,
    said with what this rank was `doing` (a forward, waiting for one, releasing the followers at the end)."""
    try:
        mx.eval(*arrays)
    except RuntimeError as err:
        if on_lost is not None and any(backend in str(err) for backend in LINK_ERRORS):
            on_lost(f"the link to another rank was lost {doing} ({err})")
        raise


class LeaderTarget:
    """Mixin put before rank 0's target class (`lead`): each forward is announced to the followers first
    and evaluated before it returns, so that a rank lost on the way is noticed here."""

    def _announce(self, header: list[int], tokens: Optional[mx.array], *, doing: str) -> None:
        group = self._split_group
        _evaluated([mx.distributed.all_sum(mx.array(header, dtype=mx.int32), group=group)], self._on_lost, doing=doing)
        if tokens is not None:
            _evaluated([mx.distributed.all_sum(tokens.astype(mx.int32), group=group)], self._on_lost, doing=doing)

    def __call__(self, inputs: mx.array, cache: Optional[list[Any]] = None, **kwargs: Any):
        if cache is None:
            raise SplitTargetError("a split target runs with caches (every forward of the engine has one)")
        if inputs.ndim != 2 or inputs.shape[0] != 1:  # the followers run (1, width): another shape would desync the ranks
            raise SplitTargetError(f"a split target runs one sequence per forward (inputs of shape (1, width), "
                                   f"not {tuple(inputs.shape)}): batched rows are not split")
        position = _position(cache)
        key = self._split_keys.get(id(cache))
        if key is None or position == 0:  # a cache starting afresh is a new one for the followers too
            self._split_count += 1
            self._split_keys.pop(id(cache), None)  # the newest last: a server makes caches for as long as it runs
            key = self._split_keys[id(cache)] = self._split_count
            while len(self._split_keys) > 4 * _FOLLOWER_CACHES:  # the followers keep fewer still
                del self._split_keys[next(iter(self._split_keys))]
        tap_ids = [int(i) for i in kwargs.get("tap_ids", ())]  # a pipeline stage adds its own into their all_sum
        words = mx.concatenate([inputs.reshape(-1).astype(mx.int32), mx.array(tap_ids, dtype=mx.int32)])
        last_only = int(bool(kwargs.get("last_only", False)))  # a head split over the vocabulary gathers its rows
        self._announce([key, position, int(inputs.shape[1]), len(tap_ids), last_only], words,
                       doing="announcing a target forward to the other ranks")
        logits, features = super().__call__(inputs, cache=cache, **kwargs)
        _evaluated([a for a in (logits, features) if a is not None], self._on_lost, doing="during a target forward")
        return logits, features

    def release_followers(self) -> None:
        """The last announcement: the followers return (call it once rank 0 is done, error or not)."""
        self._announce([STOP, 0, 0, 0, 0], None, doing="releasing the other ranks at the end (this rank's work was done)")

    def lm_head_logits(self, h: mx.array) -> mx.array:
        whole = getattr(self, "_whole_head", None)  # the head split over the vocabulary: the draft reads it whole
        return super().lm_head_logits(h) if whole is None else whole(h)

    def model_head_logits(self, h: mx.array) -> mx.array:
        whole = getattr(self, "_whole_head", None)  # a plain product (`_shard` refuses other split heads)
        return super().model_head_logits(h) if whole is None else whole(h)


def lead(target: Any, group: Any, *, on_lost: Optional[Callable[[str], None]] = None) -> Any:
    """Make rank 0's `target` announce its forwards to the followers of `group` (in place; returns it);
    `on_lost(why)` is called when a collective fails because another rank is gone (it should end the process)."""
    cls = type(target)
    target.__class__ = type(f"Leading{cls.__name__}", (LeaderTarget, cls), {})
    target._split_group = group
    target._split_keys = {}
    target._split_count = 0
    object.__setattr__(target, "_on_lost", on_lost)
    return target


def follow(target: Any, group: Any, *, max_rollback: int = 32, on_lost: Optional[Callable[[str], None]] = None) -> int:
    """Run the forwards rank 0 announces until it says STOP; returns how many were run. `on_lost` as `lead`'s."""
    caches: OrderedDict[int, Any] = OrderedDict()
    forwards = 0
    while True:
        header = mx.distributed.all_sum(mx.zeros((5,), dtype=mx.int32), group=group)
        _evaluated([header], on_lost, doing="waiting for rank 0's next target forward (rank 0 ended or its link broke)")
        key, position, length, taps, last_only = (int(v) for v in header.tolist())
        if key == STOP:
            return forwards
        words = mx.distributed.all_sum(mx.zeros((length + taps,), dtype=mx.int32), group=group)
        _evaluated([words], on_lost, doing="receiving rank 0's next target forward")
        tokens, tap_ids = words[:length], tuple(int(i) for i in words[length:].tolist())
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
        logits, _ = target(tokens.reshape(1, length), cache=cache, tap_ids=tap_ids, last_only=bool(last_only))
        _evaluated([logits], on_lost, doing="during a target forward")  # a tensor-parallel follower's taps are never evaluated: nothing computes them
        forwards += 1
