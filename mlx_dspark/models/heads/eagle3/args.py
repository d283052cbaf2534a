"""The config of an EAGLE-3 draft in vLLM speculators' layout (`speculators_model_type: eagle3`), read and
checked once; models/heads/eagle3/model.py builds the draft from it.

Fields (speculators `models/eagle3/config.py`; DRAFTERS.md section 3):
- `transformer_layer_config`: the draft layer's llama-style config (`model_type` llama, or qwen3 for q/k
  norms), whose `vocab_size` is the target's; one layer (`num_hidden_layers` 1).
- `draft_vocab_size` (the rows of `lm_head`, mapped to target ids by `d2t`), `target_hidden_size` (the
  tapped states' width, default the draft's), `norm_before_residual`, `norm_before_fc`,
  `embed_requires_grad` (true: the draft trained its own embedding table, else it is the target's).
- `eagle_aux_hidden_state_layer_ids`: the 3 tapped target layers as Hugging Face hidden-state indices
  (0 is the embedding output, i the input of layer i), vLLM's default (2, N // 2, N - 3) for an N-layer
  target when absent. Our tap ids count layer outputs (-1 the embedding: models/base.check_tap_ids),
  so EAGLE id i is our tap i - 1; the three are concatenated in layer order, as vLLM collects them.
- `speculators_config.proposal_methods[].speculative_tokens`: the chain length the draft was trained for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

SPECULATORS_TYPE = "eagle3"
LAYER_TYPES = ("llama", "qwen3")  # transformer_layer_config.model_type: qwen3 adds per-head q/k RMSNorms
ROPE_TYPES = ("default", "linear", "llama3")  # what mlx-lm's initialize_rope runs for these layers
NUM_TAPS = 3


def is_eagle3_config(config: dict) -> bool:
    return config.get("speculators_model_type") == SPECULATORS_TYPE


def default_aux_ids(num_target_layers: int) -> list[int]:
    """vLLM's `get_eagle3_aux_hidden_state_layers`: (2, N // 2, N - 3), Hugging Face hidden-state indices."""
    n = num_target_layers
    return [2, n // 2, n - 3]


def _int(fields: dict, name: str, *, where: str, source: str, default: Any = None, low: int = 1) -> int:
    value = default if fields.get(name) is None else fields[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{source}: field '{where}{name}' must be an integer >= {low}, got {value!r}")
    return value


def _bool(fields: dict, name: str, *, where: str, source: str) -> bool:
    value = False if fields.get(name) is None else fields[name]
    if not isinstance(value, bool):
        raise ValueError(f"{source}: field '{where}{name}' must be true or false, got {value!r}")
    return value


def _float(fields: dict, name: str, *, where: str, source: str, default: float) -> float:
    value = default if fields.get(name) is None else fields[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{source}: field '{where}{name}' must be a number > 0, got {value!r}")
    return float(value)


def _rope(layer: dict, *, source: str) -> tuple[float, Optional[dict]]:
    """(theta, scaling) from `rope_theta` / `rope_scaling` or transformers' newer `rope_parameters`."""
    where = "transformer_layer_config."
    params = layer.get("rope_parameters")
    scaling = layer.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{source}: field '{where}rope_parameters' must be an object, got {params!r}")
    theta = _float({**layer, **(params or {})}, "rope_theta", where=where, source=source, default=10000.0)
    scaling = scaling if scaling is not None else params
    kind = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{source}: field '{where}rope_scaling' has rope_type {kind!r}; supported: {list(ROPE_TYPES)}")
    return theta, None if kind == "default" else dict(scaling)


@dataclass(frozen=True)
class Eagle3Args:
    layer_type: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    attention_bias: bool
    mlp_bias: bool
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    norm_before_fc: bool
    own_embedding: bool  # embed_requires_grad: the draft's embedding table, not the target's
    aux_layer_ids: Optional[tuple[int, ...]]  # Hugging Face hidden-state indices; None: vLLM's default
    speculative_tokens: Optional[int]

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    def tap_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """Our tap ids (layer outputs; -1 the embedding) of the aux layers, in layer order."""
        aux = self.aux_layer_ids if self.aux_layer_ids is not None else default_aux_ids(num_target_layers)
        return tuple(sorted(i - 1 for i in aux))

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "Eagle3Args":
        if not is_eagle3_config(config):
            raise ValueError(f"{source}: speculators_model_type is {config.get('speculators_model_type')!r}, not 'eagle3'")
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"{source}: field 'transformer_layer_config' must be an object (the draft layer's config), got {layer!r}")
        w = "transformer_layer_config."
        kind = layer.get("model_type") or "llama"
        if kind not in LAYER_TYPES:
            raise ValueError(f"{source}: field '{w}model_type' is {kind!r}; EAGLE-3 layers of {list(LAYER_TYPES)} run here")
        if layer.get("num_hidden_layers") not in (None, 1):
            raise ValueError(f"{source}: field '{w}num_hidden_layers' is {layer['num_hidden_layers']!r}; only one-layer EAGLE-3 drafts run here")
        if layer.get("hidden_act") not in (None, "silu"):
            raise ValueError(f"{source}: field '{w}hidden_act' is {layer['hidden_act']!r}; only 'silu' is supported")
        hidden = _int(layer, "hidden_size", where=w, source=source)
        heads = _int(layer, "num_attention_heads", where=w, source=source)
        kv_heads = _int(layer, "num_key_value_heads", where=w, source=source, default=heads)
        if heads % kv_heads:
            raise ValueError(f"{source}: field '{w}num_key_value_heads' {kv_heads} must divide num_attention_heads {heads}")
        vocab = _int(layer, "vocab_size", where=w, source=source)
        theta, scaling = _rope(layer, source=source)
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and (not isinstance(aux, list) or len(aux) != NUM_TAPS or len(set(aux)) != NUM_TAPS
                                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in aux)):
            raise ValueError(f"{source}: field 'eagle_aux_hidden_state_layer_ids' must be {NUM_TAPS} distinct integers >= 0, got {aux!r}")
        draft_vocab = _int(config, "draft_vocab_size", where="", source=source, default=vocab)
        if draft_vocab > vocab:
            raise ValueError(f"{source}: field 'draft_vocab_size' {draft_vocab} exceeds the target vocabulary ({w}vocab_size {vocab})")
        return cls(
            layer_type=kind, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=_int(layer, "head_dim", where=w, source=source, default=hidden // heads),
            intermediate_size=_int(layer, "intermediate_size", where=w, source=source),
            rms_norm_eps=_float(layer, "rms_norm_eps", where=w, source=source, default=1e-6),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=_int(layer, "max_position_embeddings", where=w, source=source, default=4096),
            attention_bias=_bool(layer, "attention_bias", where=w, source=source),
            mlp_bias=_bool(layer, "mlp_bias", where=w, source=source),
            vocab_size=vocab, draft_vocab_size=draft_vocab,
            target_hidden_size=_int(config, "target_hidden_size", where="", source=source, default=hidden),
            norm_before_residual=_bool(config, "norm_before_residual", where="", source=source),
            norm_before_fc=_bool(config, "norm_before_fc", where="", source=source),
            own_embedding=_bool(config, "embed_requires_grad", where="", source=source),
            aux_layer_ids=None if aux is None else tuple(aux),
            speculative_tokens=_speculative_tokens(config, source=source),
        )  # fmt: skip


def _speculative_tokens(config: dict, *, source: str) -> Optional[int]:
    """The first proposal method's `speculative_tokens` (None when the config names none)."""
    spec = config.get("speculators_config")
    if spec is None:
        return None
    methods = spec.get("proposal_methods", []) if isinstance(spec, dict) else None
    if not isinstance(methods, list) or not all(isinstance(m, dict) for m in methods):
        raise ValueError(f"{source}: field 'speculators_config.proposal_methods' must be a list of objects, got {methods!r}")
    for method in methods:
        if method.get("speculative_tokens") is not None:
            return _int(method, "speculative_tokens", where="speculators_config.proposal_methods[].", source=source)
    return None
