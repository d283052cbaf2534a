"""A target made from any mlx-lm text model (`mlx_lm.models.<model_type>`), behind our target contract.

The model is mlx-lm's own class, subclassed (`target_class`): its parameters, checkpoint names,
`sanitize`, `quant_predicate`, masks, embedding scales, heads and softcaps stay exactly mlx-lm's, and
every forward runs mlx-lm's own `__call__`. What the engine needs besides logits is captured at two
boundaries, the same way for every family:

- each decoder layer records its output (the tapped features; -1 is layer 0's input, the embedding
  output after any scale the model applies): after construction each layer becomes an instance of a
  subclass of its own class whose `__call__` calls the original and records (no library code changes;
  parameter paths are untouched, so loading and quantization see the checkpoint's names);
- the module the model calls for its hidden states (its backbone: the module holding the layer list, or the
  nearest one above it that embeds, as plamo2's; under a multimodal wrapper's language model too) records its output (the final normed hidden state) and,
  for `model_head_logits(h)`, returns the given `h` so that mlx-lm's own head code (tied / untied head,
  softcap, logit scaling) computes the logits.

What a draft shares (`embed`, `lm_head_logits`) are the raw table operations: the embedding table's rows
and the plain head product. Family scales and softcaps belong to the draft's family, which applies its own
(DeepSpec's gemma4 draft scales its block embeddings by sqrt(hidden) and soft-caps its logits itself, on
copies of the target's raw table and head).

`probe_target` runs at load: a model whose forward cannot be taken apart this way (a layer not called
exactly once, a layer output that is not a hidden state, a head that is not a function of the final
hidden state alone) is refused with its `model_type` named, never approximated. Caches are mlx-lm's
own (`make_cache`); rolling them back exactly is `models/cache.trim_caches`' job.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_dspark.models.layers.base import FINAL_TAP, check_tap_ids, gather_taps
from mlx_dspark.models.caches.kv import QuantizedKVCache, kv_group_size
from mlx_dspark.models.caches.rollback import RollbackCaches, recording

# Config fields that would change a model's forward where mlx-lm's class ignores them: refused, never run wrong.
UNRUN_FIELDS = {"qwen3": {"use_sliding_window": "mlx-lm's qwen3 model has no sliding-window layers"}}
# Names of our contract that an mlx-lm model must not already use for something of its own.
CONTRACT_NAMES = ("embed", "lm_head_logits", "model_head_logits", "head_is_models_own", "embedding", "output_head", "layer_types", "kv_bits", "mlx_lm_model_type")


class Capture:
    """What one forward records at the layer boundary. A plain object (never a parameter); the model is
    driven by one thread at a time (the engine's worker)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.mode = "off"  # "off" | "forward" | "head"
        # last_only cuts the last layer's output to one position; a pipeline stage cuts after the backbone
        # instead (its final state is all-gathered over the ranks: every rank's must have one shape)
        self.cut_at_last_layer = True
        self.tap_ids: tuple[int, ...] = ()
        self.last_only = False
        self.taps: dict[int, mx.array] = {}
        self.calls = [0] * num_layers
        self.bad_output: Optional[str] = None
        self.final: Optional[mx.array] = None  # the backbone's output (the final normed hidden state)
        self.head_input: Optional[mx.array] = None

    def start(self, mode: str, *, tap_ids: tuple[int, ...] = (), last_only: bool = False) -> None:
        self.mode, self.tap_ids, self.last_only = mode, tap_ids, last_only
        self.taps, self.calls, self.bad_output, self.final = {}, [0] * self.num_layers, None, None

    def layer_call(self, layer: nn.Module, args: tuple, kwargs: dict) -> Any:
        index = layer._dspark_index
        if self.mode == "off":
            return type(layer).__mro__[1].__call__(layer, *args, **kwargs)
        if index == 0 and -1 in self.tap_ids:
            self.taps[-1] = args[0]
        self.calls[index] += 1
        out = type(layer).__mro__[1].__call__(layer, *args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out  # some families return (h, shared K/V, ...)
        if not isinstance(hidden, mx.array) or hidden.ndim != 3:
            self.bad_output = f"layer {index} returned {type(hidden).__name__} {getattr(hidden, 'shape', '')}"
            return out
        if index in self.tap_ids:
            self.taps[index] = hidden
        if self.last_only and self.cut_at_last_layer and index == self.num_layers - 1 and FINAL_TAP not in self.tap_ids:
            # the final norm and the head then run on the last position only (both are per position)
            hidden = hidden[:, -1:]
            return (hidden, *out[1:]) if isinstance(out, tuple) else hidden
        return out

    def backbone_call(self, backbone: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.mode == "head":
            return self.head_input
        out = type(backbone).__mro__[1].__call__(backbone, *args, **kwargs)
        if self.mode == "forward":
            self.final = out
            if FINAL_TAP in self.tap_ids:  # every position's final state; the head then reads the last alone
                self.taps[FINAL_TAP] = out
            if FINAL_TAP in self.tap_ids or not self.cut_at_last_layer:
                return out[:, -1:] if self.last_only else out
        return out


def _recording_layer_call(self, *args, **kwargs):
    return self._dspark_capture.layer_call(self, args, kwargs)


def _recording_backbone_call(self, *args, **kwargs):
    return self._dspark_capture.backbone_call(self, args, kwargs)


def _record_through(module: nn.Module, call, capture: Capture, subclasses: dict[type, type]) -> None:
    """Make `module` an instance of a subclass of its own class whose `__call__` is `call`."""
    base = type(module)
    if base not in subclasses:
        subclasses[base] = type(f"Recording{base.__name__}", (base,), {"__call__": call, "__module__": __name__})
    module.__class__ = subclasses[base]
    module._dspark_capture = capture  # not an array / module: stays out of the parameters


class MLXLMTarget:
    """Mixin put before an mlx-lm `Model` class by `target_class`; see the module docstring."""

    kv_bits: Optional[int] = None  # load(kv_bits=): mlx-lm's full KV caches become its QuantizedKVCache
    pipelined = False  # split pipeline-parallel (models/distributed/split_target.py): a rank runs its own run of layers only

    def __init__(self, args: Any):
        super().__init__(args)
        if getattr(self, "args", None) is None:  # plamo3, youtu_llm, ... keep their ModelArgs as `config`
            object.__setattr__(self, "args", args)
        self.mlx_lm_model_type = getattr(args, "model_type", type(self).__mro__[2].__module__.rsplit(".", 1)[-1])
        layers = getattr(self, "layers", None)
        if not isinstance(layers, list) or not layers:
            self._refuse("it has no `layers` list")
        # The backbone: the module that holds the layer list and runs it (under a multimodal wrapper's
        # language model, too). Kept outside the parameter tree: a second path to it would enter it.
        holders = [p for p, m in self.named_modules() if any(_lists(v, layers[0]) for v in m.values())]
        if len(holders) != 1:
            self._refuse("no single module holds its decoder layers")
        object.__setattr__(self, "_backbone", _backbone(self, holders[0]))
        self._capture = Capture(len(layers))
        subclasses: dict[type, type] = {}
        for i, layer in enumerate(layers):
            _record_through(layer, _recording_layer_call, self._capture, subclasses)
            layer._dspark_index = i
        _record_through(self._backbone, _recording_backbone_call, self._capture, subclasses)
        _complete_args(self, num_layers=len(layers))

    def _refuse(self, why: str) -> None:
        raise ValueError(
            f"model_type {self.mlx_lm_model_type!r}: mlx-lm's model cannot be used as a DSpark target: {why}"
        )

    @property
    def layer_types(self) -> list[str]:
        types = getattr(self.args, "layer_types", None)
        return list(types) if types else ["full_attention"] * self.args.num_hidden_layers

    @property
    def embedding(self) -> nn.Module:
        """The input embedding (the pair checks compare a draft's copy with it)."""
        found = getattr(self._backbone, "embed_tokens", None)
        if found is None:
            found = next(
                (m for _, m in self._backbone.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))), None
            )
        if found is None:
            self._refuse("no input embedding found")
        return found

    @property
    def output_head(self) -> Optional[nn.Module]:
        """The untied LM head module (under a wrapper's language model too); None when tied."""
        if self.args.tie_word_embeddings or getattr(self, "tie_word_embeddings", False) is True:
            return None  # mlx-lm's own flag too: gemma3_text's sanitize ties (and pops lm_head) on load
        return next((m for p, m in self.named_modules() if p == "lm_head" or p.endswith(".lm_head")), None)

    def make_cache(self, *, max_rollback: int = 8) -> RollbackCaches:
        """mlx-lm's own caches for the model (its `make_cache`, else `make_prompt_cache`'s KV caches), in a
        `RollbackCaches`: every forward through it is recorded, so that `trim_caches` rolls back any kind
        exactly (recurrent states, rotating windows). A verify is at most `max_record` (64) positions wide."""
        own = getattr(super(), "make_cache", None)
        caches = own() if own is not None else make_prompt_cache(SimpleNamespace(layers=self.layers))
        if self.kv_bits is not None:  # full-attention layers only: rotating windows and states stay in float
            group = kv_group_size(_head_dim(self.args))
            caches = [QuantizedKVCache(group_size=group, bits=self.kv_bits) if type(c) is KVCache else c for c in caches]
        return RollbackCaches(caches)
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        own = getattr(super(), "sanitize", None)
        weights = own(weights) if own is not None else weights
        if getattr(self, "tie_word_embeddings", False) is True:  # gemma3_text's sanitize ties a head-less checkpoint
            self.args.tie_word_embeddings = True
        return weights

    def embed(self, ids: mx.array) -> mx.array:
        """The raw rows of the input embedding table (no family scale: a draft family that scales its
        block embeddings, Gemma's sqrt(hidden), applies it itself, as DeepSpec's drafts do)."""
        return self.embedding(ids)

    head_is_models_own = False  # set by `probe_target` when no plain head product is the model's head

    def lm_head_logits(self, h: mx.array) -> mx.array:
        """The plain head product of final-normed hidden states: the untied head, else the tied table
        (`as_linear`). No family softcap / logit scale: a draft family applies its own (`cap_logits`).
        A model whose head is neither (internlm2's `output`, talkie's gained array: the probe finds out)
        gets mlx-lm's own head code instead."""
        if self.head_is_models_own:
            return self.model_head_logits(h)
        head = self.output_head
        return self.embedding.as_linear(h) if head is None else head(h)

    def model_head_logits(self, h: mx.array) -> mx.array:
        """Logits of final-normed hidden states by mlx-lm's own head code (softcap, logit scale included):
        what the target's own forward computes from them."""
        self._capture.start("head")
        self._capture.head_input = h
        try:
            return super().__call__(mx.zeros(h.shape[:2], dtype=mx.int32))
        finally:
            self._capture.head_input = None
            self._capture.start("off")

    def _complete_taps(self, logits: mx.array, taps: dict[int, mx.array], tap_ids: tuple[int, ...]) -> dict[int, mx.array]:
        """The forward's tapped states: the recorded ones (a pipeline stage fetches other ranks' layers')."""
        return taps

    def __call__(
        self,
        inputs: mx.array,
        cache: Optional[list[Any]] = None,
        *,
        tap_ids: Sequence[int] = (),
        last_only: bool = False,
    ) -> tuple[mx.array, Optional[mx.array]]:
        tap_ids = check_tap_ids(tap_ids, self.args.num_hidden_layers, final=True)
        capture = self._capture
        capture.start("forward", tap_ids=tap_ids, last_only=last_only)
        try:
            # `recording` swaps the backbone's layer list for stand-ins that record the call for rollback
            # and then call the (recording-subclassed) layer itself, so the capture still sees each layer once.
            with recording(self, cache):
                logits = super().__call__(inputs, cache=cache)
            taps = self._complete_taps(logits, capture.taps, tap_ids)
        finally:
            capture.start("off")
        if not tap_ids:
            return logits, None
        return logits, gather_taps(taps, tap_ids, feature_dtype(self, taps[tap_ids[0]]))


def feature_dtype(model: Any, first_tap: mx.array) -> mx.Dtype:
    """The dtype the draft gets the tapped features in: the layers' own, unless the class says otherwise
    (spark2_5's float32 residual is handed over in the compute dtype, as the reference does)."""
    return getattr(model, "feature_dtype", None) or first_tap.dtype


def _head_dim(args: Any) -> int:
    """The attention heads' width (what a quantized KV cache groups)."""
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def _backbone(model: nn.Module, holder: str) -> nn.Module:
    """The module whose output is the final normed hidden state: the one holding the layer list, or the
    nearest module above it that also holds the input embedding (plamo2's decoder runs the layers inside
    its backbone, which embeds before them and norms after)."""
    modules = dict(model.named_modules())
    path = holder
    while path:
        if any(isinstance(v, nn.Embedding) for v in modules[path].values()):
            return modules[path]
        path = path.rpartition(".")[0]
    return modules[holder]


def _lists(value: Any, layer: nn.Module) -> bool:
    return isinstance(value, list) and any(item is layer for item in value)


def _complete_args(model: nn.Module, *, num_layers: int) -> None:
    """The contract's `args` fields on mlx-lm's ModelArgs where it names them otherwise or not at all:
    a multimodal wrapper's text fields come from its language model's args."""
    args = model.args
    text = next(
        (a for a in [args] + [getattr(m, "args", None) for _, m in model.named_modules()]
         if getattr(a, "hidden_size", None) is not None and getattr(a, "vocab_size", None) is not None),
        None,
    )  # fmt: skip
    if text is None:
        model._refuse("its args name no hidden_size / vocab_size")
    for name in ("hidden_size", "vocab_size"):
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(text, name))
    if getattr(args, "num_hidden_layers", None) is None:
        args.num_hidden_layers = num_layers
    if getattr(args, "tie_word_embeddings", None) is None:
        tied = getattr(text, "tie_word_embeddings", None)
        args.tie_word_embeddings = tied if tied is not None else not any(p.endswith("lm_head") for p, _ in model.named_modules())


def mlx_lm_classes(config: dict, *, source: str = "config.json") -> tuple[type, type]:
    """mlx-lm's (Model, ModelArgs) for a config, as mlx-lm's loader picks them; ValueError naming the field."""
    from mlx_lm.utils import _get_classes  # mlx-lm's own choice (MODEL_REMAPPING, architecture remaps)

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{source}: field 'model_type' is missing; mlx-lm needs it to pick the model class")
    try:
        return _get_classes(config)
    except ValueError:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not a model mlx-lm implements (no mlx_lm.models.{model_type}); "
            "expected a Qwen3ForCausalLM / Spark2_5ForCausalLM target or a model_type mlx-lm knows"
        ) from None


def target_class(model_class: type) -> type:
    """Our target class over an mlx-lm `Model` class (a subclass of both)."""
    return type(f"{model_class.__name__}Target", (MLXLMTarget, model_class), {"__module__": __name__})


def from_config(config: dict, *, source: str = "config.json", model_class: Optional[type] = None) -> nn.Module:
    """The (unloaded) target for a config of any mlx-lm model; `model_class` overrides mlx-lm's choice."""
    found_class, args_class = mlx_lm_classes(config, source=source)
    model_class = model_class or found_class
    if dataclasses.is_dataclass(args_class):
        missing = [
            f.name for f in dataclasses.fields(args_class)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in config
        ]  # fmt: skip
        if missing:
            raise ValueError(f"{source}: missing field(s) {missing} for mlx-lm's {config['model_type']} model")
    clashes = [n for n in CONTRACT_NAMES if hasattr(model_class, n)]
    if clashes:
        raise ValueError(f"{source}: model_type {config['model_type']!r}: mlx-lm's model already defines {clashes}, names the target contract uses")
    model_type = config["model_type"]
    check_config = getattr(model_class, "check_config", None)  # a class of ours may refuse what it cannot run
    if check_config is not None:
        check_config(config, source=source)
    for name, why in UNRUN_FIELDS.get(model_type, {}).items():
        if config.get(name):
            raise ValueError(f"{source}: {name} {config[name]!r}: {why}; such a {model_type} target is not supported")
    try:
        args = args_class.from_dict(config)
    except (ValueError, TypeError) as e:  # mlx-lm's own checks of its ModelArgs
        raise ValueError(f"{source}: {e}") from None
    try:
        model = target_class(model_class)(args)
    except AttributeError as e:  # its __init__ assigns a name our contract defines as a property
        raise ValueError(f"{source}: model_type {config['model_type']!r}: mlx-lm's model does not fit the target contract: {e}") from None
    clashes = [n for n in CONTRACT_NAMES if n in model]
    if clashes:
        raise ValueError(f"{source}: model_type {config['model_type']!r}: mlx-lm's model holds {clashes}, names the target contract uses")
    return model


def is_mlx_lm_target(model: Any) -> bool:
    return isinstance(model, MLXLMTarget)


def probe_target(model: MLXLMTarget, *, length: int = 6) -> None:
    """Check on a short probe prompt that our forward gives the model's own logits and well-formed
    features; ValueError naming the model_type otherwise (see the module docstring)."""
    vocab = model.args.vocab_size
    ids = mx.array([[(7 + 31 * i) % vocab for i in range(length)]], dtype=mx.int32)
    model._capture.start("off")
    try:
        reference = super(MLXLMTarget, model).__call__(ids)  # mlx-lm's own forward, nothing recorded
        mx.eval(reference)
    except (ValueError, RuntimeError, TypeError, IndexError, KeyError) as e:
        raise ValueError(
            f"model_type {model.mlx_lm_model_type!r}: mlx-lm's own forward fails on a probe prompt here "
            f"({type(e).__name__}: {e})"
        ) from None
    try:
        problems = _probe_problems(model, ids, reference)
    except (ValueError, RuntimeError, TypeError, IndexError, KeyError) as e:  # mlx-lm's code failing under the recording
        problems = [f"its forward fails when recorded ({type(e).__name__}: {e})"]
    if problems:
        raise ValueError(
            f"model_type {model.mlx_lm_model_type!r}: our forward does not reproduce mlx-lm's own model, so it is "
            "not used as a DSpark target: " + "; ".join(problems)
        )


def _probe_problems(model: MLXLMTarget, ids: mx.array, reference: mx.array) -> list[str]:
    n, hidden, length = model.args.num_hidden_layers, model.args.hidden_size, ids.shape[1]
    capture = model._capture
    capture.start("forward", tap_ids=tuple(range(-1, n - 1)))
    try:
        logits = super(MLXLMTarget, model).__call__(ids)
        calls, bad, final, recorded = list(capture.calls), capture.bad_output, capture.final, dict(capture.taps)
    finally:
        capture.start("off")
    if bad:
        return [f"a decoder layer's output is not a hidden state ({bad})"]
    # a pipelined rank (split at load, before this probe) calls its own run of layers, the others none
    if calls != [1] * n and not (model.pipelined and set(calls) <= {0, 1} and any(calls)):
        return [f"its layers are not each called once per forward (calls per layer: {calls})"]
    problems = []
    shapes = {i: tuple(t.shape) for i, t in recorded.items() if tuple(t.shape) != (1, length, hidden)}
    if shapes:
        problems.append(f"tapped outputs are not (1, {length}, {hidden}) hidden states: {shapes}")
    if final is None or tuple(final.shape) != (1, length, hidden):
        problems.append(f"its backbone returns {None if final is None else tuple(final.shape)}, not the final hidden state")
    elif not _same(model.model_head_logits(final), reference):
        problems.append("its logits are not a function of the final hidden state alone (mlx-lm's head on it differs)")
    else:
        # what a draft shares: the plain head product, if it ranks tokens as the model's logits do (softcaps
        # and logit scales are monotone: the head found is the model's own); else mlx-lm's head code
        model.head_is_models_own = False
        plain = model.lm_head_logits(final)
        model.head_is_models_own = plain.shape != reference.shape or not _same(mx.argmax(plain, axis=-1), mx.argmax(reference, axis=-1))
    if not _same(logits, reference):
        problems.append("the recorded forward's logits differ from its own __call__")
    if problems:
        return problems
    rows = model.embed(ids)
    if tuple(rows.shape) != (1, length, hidden):
        problems.append(f"its input embedding gives {tuple(rows.shape)}, not the table's (1, {length}, {hidden}) rows")
    last, _ = model(ids, last_only=True)
    if not mx.allclose(last, reference[:, -1:], rtol=1e-5, atol=1e-5).item():
        problems.append("the last position's logits alone differ from the full forward's")
    return problems


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and mx.array_equal(a, b).item()


def check_quantized_caches(model: MLXLMTarget, bits: int, *, source: str) -> None:
    """Give the target `bits`-bit full-attention KV caches (load(kv_bits=)), after checking on a two-token
    forward that its attention runs on mlx-lm's quantized cache; ValueError naming the model_type otherwise."""
    try:
        kv_group_size(_head_dim(model.args))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    model.kv_bits = bits
    caches = model.make_cache()
    problem = None
    if not any(isinstance(c, QuantizedKVCache) for c in caches):
        problem = "it has no full-attention KV cache to quantize"
    else:
        try:
            mx.eval(model(mx.array([[1, 2]], dtype=mx.int32), cache=caches)[0])
        except (ValueError, RuntimeError, TypeError, AttributeError, NotImplementedError) as e:
            problem = f"its attention does not run on mlx-lm's quantized KV cache ({type(e).__name__}: {e})"
    if problem is not None:
        model.kv_bits = None
        raise ValueError(f"{source}: kv_bits: model_type {model.mlx_lm_model_type!r}: {problem}; load it without kv_bits")
