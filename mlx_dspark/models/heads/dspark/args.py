"""What a DSpark draft is, read once per load (DSPARK.md sections 3 and 6).

- Whether a config is a draft's: it carries `target_layer_ids` (top level, or nested).
- Its DSpark fields, from any published packaging: at the top level (DeepSpec) or nested under
  `dflash_config` (SpecForge / LiquidAI / z-lab exports); a field given in both places must agree.
- EAGLE-3-style exports (SpecForge, speculators): the layer fields under `transformer_layer_config`,
  the taps as `aux_hidden_state_layer_ids` (= target layer ids + 1), and a bonus-anchor block by
  default (`sample_from_anchor` false), read as upstream's converter reads them (`flat_config`).
- Its packaging beyond DeepSpec's (`models/heads/dspark/packaging.py`): scales, a bonus-anchor block, a
  reduced vocabulary, interleaved-RoPE weights (`rope_is_neox_style: false`).
- Its tensor names: DeepSpec's, after dropping a `model.` prefix (speculators / EasyDeL exports).
- Its layer family, from its tensors (never from the target, the config name or `model_type`):
  fused `q_k_v_proj` = spark2_5-style layers, `q_proj` = qwen3-style.
- `DraftArgs`: the DSpark fields plus the family's own `ModelArgs`, read from the same config by the
  family module, so one place says what a family's layers, RoPE and windows are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx

from mlx_dspark.models import FAMILIES, family_module
from mlx_dspark.models.heads.dspark.markov import MARKOV_HEAD_TYPES
from mlx_dspark.models.heads.dspark.dflash2_args import DFlash2Fields, check_dflash2_heads, dflash2_fields
from mlx_dspark.models.heads.dspark.packaging import (
    BONUS_ANCHOR_ARCHITECTURES,
    EAGLE3_MARKERS,
    PACKAGING_FIELDS,
    Packaging,
    check_graph,
    check_window_fields,
    check_zlab_rope,
    speculators_layers,
    whole_head_rope,
)

DSPARK_FIELDS = (
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "num_target_layers",
    "confidence_temperatures",
    *PACKAGING_FIELDS,
)
NESTED_FIELDS = "dflash_config"
MODEL_PREFIX = "model."


def flat_config(config: dict, *, source: str = "config.json") -> dict:
    """An EAGLE-3-style draft config in DeepSpec's flat form (others unchanged): the fields of
    `transformer_layer_config` at the top level, `aux_hidden_state_layer_ids` (target ids + 1) as
    `target_layer_ids`, and `sample_from_anchor` false unless the config says otherwise."""
    check_graph(config, source=source)
    arch = (config.get("architectures") or [None])[0]
    if arch in BONUS_ANCHOR_ARCHITECTURES:
        check_zlab_rope(config, source=source)
        config = whole_head_rope(config)
        given = dspark_fields(config, source=source)
        if "sample_from_anchor" not in given:
            config = {**config, "sample_from_anchor": False}
        if "target_layer_ids" not in given:
            config = {**config, "target_layer_ids": zlab_tap_ids({**config, **given}, source=source)}  # num_target_layers nested too
    if not any(k in config for k in EAGLE3_MARKERS):
        return config
    flat = dict(config)
    layer = config.get("transformer_layer_config")
    if layer is not None:
        if not isinstance(layer, dict):
            raise ValueError(f"{source}: field 'transformer_layer_config' must be an object, got {layer!r}")
        if "speculators_model_type" in config:
            layer = speculators_layers(config, layer, source=source)
        flat.update(layer)
    flat.setdefault("sample_from_anchor", False)
    aux = config.get("aux_hidden_state_layer_ids")
    if aux is not None:
        if not isinstance(aux, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
            raise ValueError(f"{source}: field 'aux_hidden_state_layer_ids' must be a list of integers, got {aux!r}")
        taps = [i - 1 for i in aux]
        given = dspark_fields(config, source=source).get("target_layer_ids")
        if given is not None and list(given) != taps:
            raise ValueError(
                f"{source}: target_layer_ids {given!r} disagrees with aux_hidden_state_layer_ids {aux!r} "
                "(which hold target layer ids + 1)"
            )
        flat["target_layer_ids"] = taps
    return flat


def with_tensor_fields(config: dict, shapes: dict[str, tuple[int, ...]], *, source: str = "config.json") -> dict:
    """A config with the DSpark fields its tensors determine filled in where it leaves them out, as
    upstream's converter reads exports that carry none (EAGLE-3 / speculators configs): the Markov
    rank from `markov_w1`'s shape (head type vanilla), the confidence head from its presence and
    whether it reads the Markov feature from its width. Fields the config gives are never replaced."""
    given = dspark_fields(flat_config(config, source=source), source=source)
    filled = dict(config)
    w1 = shapes.get("markov_head.markov_w1.weight")
    if "markov_rank" not in given:
        filled["markov_rank"] = w1[1] if w1 else 0
    if "markov_head_type" not in given and w1:
        filled["markov_head_type"] = "vanilla"
    conf = shapes.get("confidence_head.proj.weight")
    if "enable_confidence_head" not in given:
        filled["enable_confidence_head"] = conf is not None
    if "confidence_head_with_markov" not in given and conf is not None and w1:
        filled["confidence_head_with_markov"] = conf[1] > shapes.get("fc.weight", (conf[1],))[0]
    return filled


def dspark_fields(config: dict, *, source: str) -> dict[str, Any]:
    """The DSpark fields of a draft config, from the top level and/or `dflash_config`."""
    nested = config.get(NESTED_FIELDS) or {}
    if not isinstance(nested, dict):
        raise ValueError(f"{source}: field {NESTED_FIELDS!r} must be an object, got {nested!r}")
    fields = {}
    for name in DSPARK_FIELDS:
        top, inner = config.get(name), nested.get(name)
        if top is not None and inner is not None and top != inner:
            raise ValueError(f"{source}: {name} is {top!r} but {NESTED_FIELDS}.{name} is {inner!r}; they must agree")
        value = inner if inner is not None else top
        if value is not None:
            fields[name] = value
    return fields


def is_draft_config(config: dict) -> bool:
    """A DSpark draft's config names the target layers it reads (one rule for the loader and converter)."""
    nested = config.get(NESTED_FIELDS)
    return (
        "target_layer_ids" in config
        or "aux_hidden_state_layer_ids" in config
        or (isinstance(nested, dict) and "target_layer_ids" in nested)
        or (config.get("architectures") or [None])[0] in BONUS_ANCHOR_ARCHITECTURES  # z-lab: taps may be implied
    )


def zlab_tap_ids(config: dict, *, source: str) -> list[int]:
    """z-lab DFlash's taps when its config names none (`dflash/model.py` `build_target_layer_ids`): one
    per draft layer, spread evenly over target layers 1 .. L-3 (the middle one for a one-layer draft)."""
    target, draft = config.get("num_target_layers"), config.get("num_hidden_layers")
    if not isinstance(target, int) or not isinstance(draft, int) or target < 4 or draft < 1:
        raise ValueError(
            f"{source}: no target_layer_ids (top level or under {NESTED_FIELDS!r}) and no num_target_layers / "
            "num_hidden_layers to derive z-lab DFlash's default taps from"
        )
    if draft == 1:
        return [target // 2]
    return [int(round(1 + i * (target - 4) / (draft - 1))) for i in range(draft)]


def canonical_name(name: str) -> str:
    return name[len(MODEL_PREFIX) :] if name.startswith(MODEL_PREFIX) else name


def canonical_names(
    weights: dict[str, mx.array], origin: dict[str, str], *, source: str
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Draft tensors (and where each came from) under DeepSpec's names: a `model.` prefix dropped."""
    renamed: dict[str, mx.array] = {}
    renamed_origin: dict[str, str] = {}
    for name, array in weights.items():
        key = canonical_name(name)
        if key in renamed:
            raise ValueError(f"{source}: draft tensor {key!r} is stored both with and without the {MODEL_PREFIX!r} prefix")
        renamed[key] = array
        renamed_origin[key] = origin[name]
    return renamed, renamed_origin


def layer_family(names: list[str], *, source: str) -> str:
    """The draft's layer family from its tensor names (DeepSpec names: `layers.N.self_attn.*`)."""
    # a family's marks must all be present; the most specific match wins (gemma4's include qwen3's q_proj)
    marks = {family: _draft_marks(family) for family in FAMILIES}
    present = {m for m in set().union(*marks.values()) if any(n.startswith("layers.") and n.endswith("." + m) for n in names)}
    matched = [f for f, need in marks.items() if need <= present]
    found = sorted(f for f in matched if not any(marks[f] < marks[g] for g in matched))
    if len(found) == 1:
        return found[0]
    layer0 = sorted(n for n in names if n.startswith("layers.0."))
    expected = ", ".join(f"{' + '.join(f'layers.N.{m}' for m in sorted(need))} ({family}-style)" for family, need in marks.items())
    what = "both kinds" if found else "neither"
    raise ValueError(
        f"{source}: cannot tell the draft's layer family from its tensors: expected one of {expected}, found {what}; "
        f"layer 0 holds {layer0 or 'nothing'}"
    )


def _draft_marks(family: str) -> frozenset[str]:
    module = family_module(family)
    return frozenset(getattr(module, "DRAFT_MARKS", (module.ATTENTION_TENSOR,)))


def _int_field(name: str, value: Any, *, low: int, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{source}: field {name!r} must be an integer >= {low}, got {value!r}")
    return value


def _confidence_temperatures(value: Any, *, block_size: int, confidence: bool, source: str) -> Optional[tuple[float, ...]]:
    """The confidence head's calibration: one positive temperature per block position, or None."""
    if value is None:
        return None
    ok = (
        confidence
        and isinstance(value, list)
        and len(value) == block_size
        and all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in value)
    )
    if not ok:
        raise ValueError(
            f"{source}: field 'confidence_temperatures' must be a list of {block_size} positive numbers "
            f"(one per block position) on a draft with a confidence head, got {value!r}"
        )
    return tuple(float(t) for t in value)


@dataclass(frozen=True)
class DraftArgs:
    family: str  # the layer family ("qwen3" / "spark2_5"), read from the draft's tensors
    layers: Any  # the family's ModelArgs, read by the family module from the draft's config
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    markov_rank: int
    markov_head_type: Optional[str]
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    num_target_layers: Optional[int]  # the depth of the target it was trained on, when the config says
    # per block position, fitted by calibration after training (mlx_dspark.train.calibration); None: T = 1
    confidence_temperatures: Optional[tuple[float, ...]] = None
    packaging: Packaging = Packaging()
    # false: q/k (and their norms) are stored in the interleaved RoPE order; permuted to rotate-half on load
    rope_is_neox_style: bool = True
    dflash2: Optional[DFlash2Fields] = None  # a DFlash 2 draft's convolutions and selector (models/heads/dspark/dflash2.py)

    @classmethod
    def from_dict(
        cls, config: dict, *, family: str, source: str = "config.json", tap_ids: Optional[list[int]] = None
    ) -> "DraftArgs":
        """Parse a draft config once. `tap_ids` replaces the config's `target_layer_ids` (files written
        by converters with another tap convention)."""
        config = flat_config(config, source=source)
        fields = dspark_fields(config, source=source)
        if tap_ids is not None:
            fields["target_layer_ids"] = list(tap_ids)
        missing = [k for k in ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "enable_confidence_head") if k not in fields]
        if missing:
            raise ValueError(f"{source}: missing DSpark field(s) {missing} (top level or under {NESTED_FIELDS!r})")
        layers = family_module(family).ModelArgs.from_dict(config, source=source)
        check_window_fields(config, [layers.layer_window(t) for t in layers.layer_types], source=source)
        ids = fields["target_layer_ids"]
        if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= -1 for i in ids):
            raise ValueError(f"{source}: field 'target_layer_ids' must be a non-empty list of layer ids >= -1, got {ids!r}")
        markov_rank = _int_field("markov_rank", fields["markov_rank"], low=0, source=source)
        head_type = fields.get("markov_head_type")
        if markov_rank > 0 and head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"{source}: field 'markov_head_type' is {head_type!r}; expected one of {list(MARKOV_HEAD_TYPES)} "
                f"(markov_rank is {markov_rank})"
            )
        confidence = bool(fields["enable_confidence_head"])
        if confidence and "confidence_head_with_markov" not in fields:
            raise ValueError(f"{source}: field 'confidence_head_with_markov' is missing (enable_confidence_head is true)")
        with_markov = confidence and bool(fields.get("confidence_head_with_markov", False))
        if with_markov and markov_rank == 0:
            raise ValueError(f"{source}: confidence_head_with_markov needs a Markov head, but markov_rank is 0")
        num_target_layers = fields.get("num_target_layers")
        if num_target_layers is not None:
            num_target_layers = _int_field("num_target_layers", num_target_layers, low=1, source=source)
        block_size = _int_field("block_size", fields["block_size"], low=1, source=source)
        temperatures = _confidence_temperatures(fields.get("confidence_temperatures"), block_size=block_size, confidence=confidence, source=source)
        # a packaging field the layer family itself reads (gemma4's final_logit_softcapping) is the family's
        own = {k: v for k, v in fields.items() if not hasattr(layers, k)}
        dflash2 = dflash2_fields(config, hidden_size=layers.hidden_size, vocab_size=layers.vocab_size, source=source)
        if dflash2 is not None:  # its selector applies these (DSpark's graph would not); it drafts from row 1
            own = {k: v for k, v in own.items() if k not in ("output_multiplier", "final_logit_softcapping")}
            own.setdefault("sample_from_anchor", False)
        packaging = Packaging.from_fields(own, vocab_size=layers.vocab_size, source=source)
        if dflash2 is not None:
            check_dflash2_heads(
                sample_from_anchor=packaging.sample_from_anchor, draft_vocab_size=packaging.draft_vocab_size,
                markov_rank=markov_rank, confidence=confidence, source=source,
            )  # fmt: skip
        if not packaging.sample_from_anchor and block_size < 2:
            raise ValueError(f"{source}: block_size {block_size} leaves no draft row (sample_from_anchor is false: row 0 is the anchor)")
        neox = config.get("rope_is_neox_style", True)
        if not isinstance(neox, bool):
            raise ValueError(f"{source}: field 'rope_is_neox_style' must be true or false, got {neox!r}")
        if not neox and family != "qwen3":
            raise ValueError(f"{source}: rope_is_neox_style false is only read for qwen3-style draft layers (q_proj / k_proj)")
        return cls(
            family=family,
            layers=layers,
            block_size=block_size,
            target_layer_ids=tuple(ids),
            mask_token_id=_int_field("mask_token_id", fields["mask_token_id"], low=0, source=source),
            markov_rank=markov_rank,
            markov_head_type=head_type if markov_rank > 0 else None,
            enable_confidence_head=confidence,
            confidence_head_with_markov=with_markov,
            num_target_layers=num_target_layers,
            confidence_temperatures=temperatures,
            packaging=packaging,
            rope_is_neox_style=neox,
            dflash2=dflash2,
        )

    @property
    def num_drafts(self) -> int:
        """The most draft tokens one block yields (a bonus-anchor block's row 0 yields none)."""
        return self.block_size - self.packaging.first_draft_row

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layers.vocab_size

    @property
    def num_hidden_layers(self) -> int:
        return self.layers.num_hidden_layers

    @property
    def layer_types(self) -> list[str]:
        return list(self.layers.layer_types)

    def layer_window(self, layer: int) -> Optional[int]:
        """The window of draft layer `layer` (None: it sees all context), as its family reads it."""
        return self.layers.layer_window(self.layers.layer_types[layer])
