"""How a published DSpark draft is packaged beyond DeepSpec's layout, read once from its config.

Upstream llama.cpp (conversion/qwen.py `DFlashModel` / `DSparkModel`, src/models/dflash.cpp) reads
these from SpecForge / EAGLE-3 / z-lab exports; each is a config field here (top level or under
`dflash_config`), written by our GGUF reader from the `dflash.*` keys of the same meaning:

- `sample_from_anchor` (default true): false is a bonus-anchor block: row 0 (the anchor) yields no
  draft, drafts and the Markov chain start at row 1, so a block holds `block_size - 1` drafts.
  EAGLE-3-style configs (`transformer_layer_config` / `aux_hidden_state_layer_ids`) default to false.
- `attention_value_scale`: the attention output (after the output projection) times this.
- `attention_scale`: the softmax scale instead of 1/sqrt(head_dim) (GGUF `attention.scale`).
- `input_embedding_scale`: the block's token embeddings times this.
- `markov_w2_scale`: the Markov bias times this (GGUF tensor `markov_w2.scale`, one value).
- `draft_vocab_size` with a `d2t` tensor: a reduced draft vocabulary (see `models/heads/d2t.py`).
- `output_multiplier` / `final_logit_softcapping`: refused when they change anything: upstream's
  DSpark graph reads them but applies them nowhere (only DFlash2's does), so what such a draft was
  trained with is unknown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

PACKAGING_FIELDS = (
    "sample_from_anchor",
    "attention_value_scale",
    "attention_scale",
    "input_embedding_scale",
    "markov_w2_scale",
    "draft_vocab_size",
    "output_multiplier",
    "final_logit_softcapping",
)
EAGLE3_MARKERS = ("transformer_layer_config", "aux_hidden_state_layer_ids")
# Drafts whose block is [anchor, mask ...] with drafts from row 1 although their config does not say
# so: z-lab's DFlash (`dflash/model.py` drafts from logits[:, 1 - block_size:]).
BONUS_ANCHOR_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
# vLLM speculators' draft kinds (`speculators_model_type`) whose graph is ours (a DFlash backbone,
# DSpark's Markov and confidence heads on top)
SPECULATORS_TYPES = ("dflash", "dspark")
# Config keys of drafts that share the DFlash name but not its graph: one line naming the key.
_OTHER_GRAPHS = {
    "hyper_connection_count": "a DeepSeek-V4 DSpark draft (hyper-connections)",
}
# Flags (as mlx-vlm's DFlash configs read them) that, when true, change the block forward we run: refused.
_BLOCK_FLAGS = {
    "is_causal": "the draft's block would attend causally; ours attends to the whole block (DFlash / DSpark)",
    "causal": "the draft's block would attend causally; ours attends to the whole block (DFlash / DSpark)",
    "dflash_query_causal": "the draft's block would attend causally; ours attends to the whole block (DFlash / DSpark)",
    "attention_sink_bias": "the draft's attention has learned sink logits, which ours does not",
}


def check_graph(config: dict, *, source: str) -> None:
    """Refuse, by the key that shows it, a draft whose forward is not the DSpark / DFlash one we run."""
    nested = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    for where, fields in (("", config), ("dflash_config.", nested)):
        for key in fields:
            kind = _OTHER_GRAPHS.get(key)
            if kind is not None:
                raise ValueError(f"{source}: field '{where}{key}' is set: this is {kind}, which we do not run; use a DSpark or DFlash draft")
            what = _BLOCK_FLAGS.get(key)
            if what is not None and fields[key] not in (None, False):
                raise ValueError(f"{source}: field '{where}{key}' is {fields[key]!r}: {what}; not supported")
    kind = config.get("speculators_model_type")
    if kind is not None and kind not in SPECULATORS_TYPES:
        raise ValueError(
            f"{source}: speculators_model_type is {kind!r}; only {list(SPECULATORS_TYPES)} speculators drafts run here "
            "(their DFlash block is our draft's)"
        )


def speculators_layers(config: dict, layer: dict, *, source: str) -> dict:
    """The layer fields of a speculators draft as its DFlash backbone reads them: one RoPE for every
    layer (`flatten_rope_parameters` takes the `sliding_attention` entry of a per-type table); sliding
    layers must be non-causal inside the block (`sliding_window_non_causal`), as ours are."""
    layer = dict(layer)
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict) and "sliding_attention" in rope:
        layer["rope_parameters"] = rope = rope["sliding_attention"]
        layer.pop("rope_theta", None)
    layer = whole_head_rope(layer)
    types, count = layer.get("layer_types"), layer.get("num_hidden_layers")
    if isinstance(types, list) and isinstance(count, int):
        # the verifier's text config with the draft's depth: draft layer i reads layer_types[i] and only
        # asks whether it slides (a hybrid verifier's linear_attention entries are full attention there)
        layer["layer_types"] = ["sliding_attention" if t == "sliding_attention" else "full_attention" for t in types[:count]]
    if "sliding_attention" in (layer.get("layer_types") or []) and not config.get("sliding_window_non_causal", False):
        raise ValueError(
            f"{source}: sliding_window_non_causal is false: the draft's sliding layers attend causally inside the block, "
            "ours attend to the whole block; not supported"
        )
    hidden = config.get("target_hidden_size")
    if hidden is not None and hidden != layer.get("hidden_size"):
        raise ValueError(f"{source}: target_hidden_size {hidden} differs from the draft's hidden_size {layer.get('hidden_size')}; not supported")
    return layer


def whole_head_rope(layer: dict) -> dict:
    """The layer fields with `rope_parameters.partial_rotary_factor` dropped: the DFlash backbone's
    Qwen3RotaryEmbedding (z-lab `dflash/model.py`, speculators) turns the whole head whatever it says, as
    mlx-vlm's DFlash / DFlash2 drafts do (RoPE over `head_dim`)."""
    rope = layer.get("rope_parameters")
    if not (isinstance(rope, dict) and "partial_rotary_factor" in rope):
        return layer
    return {**layer, "rope_parameters": {k: v for k, v in rope.items() if k != "partial_rotary_factor"}}


def check_zlab_rope(config: dict, *, source: str) -> None:
    """A top-level `partial_rotary_factor` other than 1 on a z-lab DFlash / DFlash2 config: z-lab's pinned
    transformers (4.57.1) turns only that share of the head, transformers 5 and mlx-vlm the whole head;
    what the draft was trained with is unknown, so it is refused."""
    factor = config.get("partial_rotary_factor")
    if factor is not None and factor != 1:
        raise ValueError(
            f"{source}: field 'partial_rotary_factor' is {factor!r} on a z-lab DFlash draft: transformers 4.57 turns that "
            "share of each head, transformers 5 and mlx-vlm the whole head; which one it was trained with is unknown; not supported"
        )


def check_window_fields(config: dict, windows: list[Optional[int]], *, source: str) -> None:
    """`dflash_config.swa_window_size` / `.sliding_window` / `.use_swa` (read by mlx-vlm, LMDeploy and
    TensorRT-LLM, some in place of the layer config's window) must say what the layer config does:
    `windows` are the draft layers' windows as we run them (None: full attention)."""
    nested = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    used = sorted({w for w in windows if w is not None})
    for key in ("swa_window_size", "sliding_window"):
        value = nested.get(key)
        if key not in nested or (value is None and not used):
            continue
        given = None if value in (0, -1) else value  # LMDeploy's no-window values
        if [given] != (used or [None]):
            raise ValueError(
                f"{source}: field 'dflash_config.{key}' is {value!r} but the draft's layers (layer_types, sliding_window, "
                f"use_sliding_window) slide {'with window ' + str(used[0]) if len(used) == 1 else used or 'no layer'}; "
                "they must agree"
            )
    if nested.get("use_swa") and not used:
        raise ValueError(
            f"{source}: field 'dflash_config.use_swa' is true but the draft's layers (layer_types, sliding_window, "
            "use_sliding_window) slide no layer; they must agree"
        )


def _scale(fields: dict, name: str, *, source: str) -> Optional[float]:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
        raise ValueError(f"{source}: field {name!r} must be a finite non-zero number, got {value!r}")
    return None if value == 1 else float(value)


@dataclass(frozen=True)
class Packaging:
    sample_from_anchor: bool = True
    value_scale: Optional[float] = None  # None: 1
    attention_scale: Optional[float] = None  # None: 1/sqrt(head_dim)
    embedding_scale: Optional[float] = None  # None: 1
    markov_w2_scale: Optional[float] = None  # None: 1
    draft_vocab_size: Optional[int] = None  # None: the target's whole vocabulary

    @classmethod
    def from_fields(cls, fields: dict[str, Any], *, vocab_size: int, source: str) -> "Packaging":
        anchor = fields.get("sample_from_anchor", True)
        if not isinstance(anchor, bool):
            raise ValueError(f"{source}: field 'sample_from_anchor' must be true or false, got {anchor!r}")
        for name, identity in (("output_multiplier", 1), ("final_logit_softcapping", 0)):
            value = fields.get(name)
            if value is not None and value != identity:
                raise ValueError(
                    f"{source}: field {name!r} is {value!r}; not supported: upstream's DSpark runtime reads it but "
                    "applies it nowhere, so how the draft's logits were trained with it is unknown"
                )
        draft_vocab = fields.get("draft_vocab_size")
        if draft_vocab == vocab_size:
            draft_vocab = None  # speculators always writes it; the whole vocabulary is no reduction
        if draft_vocab is not None:
            if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= vocab_size:
                raise ValueError(f"{source}: field 'draft_vocab_size' must be an integer in [1, {vocab_size}], got {draft_vocab!r}")
        return cls(
            sample_from_anchor=anchor,
            value_scale=_scale(fields, "attention_value_scale", source=source),
            attention_scale=_scale(fields, "attention_scale", source=source),
            embedding_scale=_scale(fields, "input_embedding_scale", source=source),
            markov_w2_scale=_scale(fields, "markov_w2_scale", source=source),
            draft_vocab_size=draft_vocab,
        )

    @property
    def first_draft_row(self) -> int:
        """The block row of draft token 1: 0 (the anchor row predicts) or 1 (a bonus-anchor block)."""
        return 0 if self.sample_from_anchor else 1
