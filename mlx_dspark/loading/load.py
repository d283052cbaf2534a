"""Loading a target (and optionally its DSpark draft): `load()`, and building either model from a
`Checkpoint` (config dict + lazy weights), whatever file format it was read from.

`load(target, draft=None, *, dtype=None, quantize=None, q_group_size=64, draft_tap_ids=None)` returns
a `LoadedModel`. Either path may be a checkpoint directory, a Hugging Face repo id, a `.gguf` file, a
directory holding one GGUF, or one GGUF file of a repo (`owner/name:FILE.gguf`); `read_checkpoint`
turns each into the same `Checkpoint`, so everything below is format-blind. Weights are checked
strictly against the model built from the config (`weights.py`); the pair is validated and the draft's
frozen copies of the target's embedding / LM head are compared with the target's and dropped (`pair.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_dspark.loading.checkpoint import Checkpoint, read_checkpoint, resolve_path
from mlx_dspark.models.target.finite import check_finite_weights
from mlx_dspark.models import target_model_class
from mlx_dspark.models.target.mlx_lm import check_quantized_caches, from_config as mlx_lm_target_from_config, probe_target
from mlx_dspark.models.heads.dspark import draft_class
from mlx_dspark.models.heads.dspark.model import SHARED_PREFIXES, DSparkDraft
from mlx_dspark.models.heads.dspark.args import DraftArgs, canonical_names, is_draft_config, layer_family, with_tensor_fields
from mlx_dspark.models.heads.dspark.packaging import BONUS_ANCHOR_ARCHITECTURES
from mlx_dspark.loading.heads import FALLBACK as BLOCK_DRAFT, declares, detect_head, file_heads, generic, head_loader, target_heads, target_weights
from mlx_dspark.loading.pair import check_shared_tensors, check_zlab_block_embedding, validate_pair
from mlx_dspark.loading.precision import (
    DRAFT_SOURCE_PRECISION,
    check_draft_quantize,
    check_quantize_options,
    parse_dtype,
    quant_predicate,
)
from mlx_dspark.loading.rank_vocab import find_rank_file, read_ranked_ids
from mlx_dspark.loading.tokenizer import load_tokenizer
from mlx_dspark.models.caches.kv import check_kv_bits
from mlx_dspark.models.heads import HEADS
from mlx_dspark.models.heads.draft_vocab import DraftVocabulary
from mlx_dspark.loading.weights import fill_model


def split_draft(draft: Any) -> tuple[list[Any], dict[str, Optional[str]]]:
    """(the draft files to load, the heads wanted from the target's own checkpoint by name, each with its argument:
    "NAME:ARG" -> {NAME: "ARG"}, "NAME" -> {NAME: None}) from `draft=`: a path, such a head's name, several joined by
    commas ("PATH,NAME", "DSPARK_PATH,EAGLE3_PATH"), or a list of those."""
    if draft is None:
        return [], {}
    if isinstance(draft, (list, tuple)):
        entries = list(draft)
    elif isinstance(draft, str) and "," in draft and not Path(draft).exists():
        entries = [e.strip() for e in draft.split(",")]
    else:
        entries = [draft]
    if any(isinstance(e, str) and not e for e in entries):
        raise ValueError(f"draft: an empty entry in {draft!r}; give paths (or {' / '.join(map(repr, target_heads()))}) separated by single commas")
    own = target_heads()
    wanted: dict[str, Optional[str]] = {}
    files = []
    for entry in entries:
        name, colon, arg = entry.partition(":") if isinstance(entry, str) else (entry, "", "")
        if name not in own or (colon and Path(entry).exists()):
            files.append(entry)
            continue
        if colon and not declares(name, "TAKES_ARG"):
            raise ValueError(f"draft: {entry!r}: {name!r} ({head_loader(name).DESCRIPTION}) takes no ':' argument; give {name!r}")
        wanted[name] = arg if colon else None
    return files, {name: wanted[name] for name in own if name in wanted}


def read_draft_files(drafts: Sequence[Any], *, tap_ids: Optional[Sequence[int]]) -> dict[str, tuple[Path, Checkpoint]]:
    """Each draft file's checkpoint by the head it is (each head's `detect`); two files of one head are refused
    in one line."""
    files: dict[str, tuple[Path, Checkpoint]] = {}
    for draft in drafts:
        path = resolve_path(draft, role="draft")
        checkpoint = read_checkpoint(path, role="draft", tap_ids=tap_ids)
        head = detect_head(checkpoint.config)
        if head in files:
            kinds = ", ".join(head_loader(name).DESCRIPTION for name in file_heads())
            own = " and ".join(repr(name) for name in target_heads())
            raise ValueError(
                f"draft: {files[head][0]} and {path} are both {head_loader(head).DESCRIPTION}; give at most one draft of "
                f"each kind ({kinds}) and {own}, separated by commas"
            )
        files[head] = (path, checkpoint)
    return files


@dataclass
class LoadedModel:
    target: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    target_config: dict
    target_path: Path
    heads: dict[str, nn.Module] = field(default_factory=dict)  # the draft heads by name (models.heads.HEADS)
    draft_config: Optional[dict] = None  # the pair's draft file: the block draft's, else the one other head's
    draft_path: Optional[Path] = None
    # each draft file's (path, config) by head: several may be loaded at once
    head_files: dict[str, tuple[Path, dict]] = field(default_factory=dict)

    @property
    def draft(self) -> Optional[nn.Module]:
        """The block draft (DSpark, DFlash, DFlash 2), the head most of the engine's options shape."""
        return self.heads.get(BLOCK_DRAFT)

    def head_source(self, head: str) -> tuple[Optional[Path], Optional[dict]]:
        """(path, config) of the file a head was read from; the pair's draft file for a head read from the target."""
        return self.head_files.get(head, (self.draft_path, self.draft_config))


def build_target(checkpoint: Checkpoint, *, dtype: Optional[mx.Dtype] = None) -> nn.Module:
    """The target model of a checkpoint, its (lazy) weights in place; dtype None: the checkpoint's
    `default_dtype` (a GGUF's compute dtype), else the weights as stored."""
    config, source = checkpoint.config, checkpoint.config_source
    head = next((name for name in file_heads() if not generic(name) and head_loader(name).detect(config)), None)
    if head is not None:
        raise ValueError(f"{source}: this is {head_loader(head).DESCRIPTION}, not a target; pass it as draft=, with its target")
    model = mlx_lm_target_from_config(config, source=source, model_class=target_model_class(config))
    return fill_model(
        model, config, target_weights(config, dict(checkpoint.weights)), checkpoint.origin,
        source=str(checkpoint.path), what="target", dtype=checkpoint.default_dtype if dtype is None else dtype, config_name=Path(source).name,
    )  # fmt: skip


def build_draft(
    checkpoint: Checkpoint,
    *,
    target: Optional[nn.Module] = None,
    target_source: str = "target",
    dtype: Optional[mx.Dtype] = None,
    tap_ids: Optional[Sequence[int]] = None,
) -> tuple[DSparkDraft, dict[str, mx.array]]:
    """(draft, its copies of the target's embedding / LM head as stored, possibly none).

    With `target`, the pair is validated before any weight is checked; `tap_ids` replaces the config's
    `target_layer_ids` (then validated against the target under the name `draft_tap_ids`)."""
    config, config_source, source = checkpoint.config, checkpoint.config_source, str(checkpoint.path)
    if not is_draft_config(config):
        raise ValueError(
            f"{config_source}: not a DSpark draft: no target_layer_ids (top level or under dflash_config); "
            "pass a draft checkpoint as draft="
        )
    mask_file = Path(checkpoint.path) / "mask_embedding.pt"
    if mask_file.is_file():
        # the draft's own mask row (upstream's converter patches it into the draft's token_embd)
        raise ValueError(
            f"{mask_file}: the draft's own mask embedding is a PyTorch pickle, which we do not read; convert the "
            "draft with llama.cpp's convert_hf_to_gguf.py (it writes the row into the draft's token_embd) and load the GGUF"
        )
    # Read once: DeepSpec tensor names from any packaging, the layer family from them, then the args.
    weights, origin = canonical_names(checkpoint.weights, checkpoint.origin, source=source)
    config = with_tensor_fields(config, {k: tuple(v.shape) for k, v in weights.items()}, source=config_source)
    family = layer_family(list(weights), source=source)
    args = DraftArgs.from_dict(config, family=family, source=config_source, tap_ids=None if tap_ids is None else list(tap_ids))
    taps_field = "target_layer_ids" if tap_ids is None else "draft_tap_ids"
    if target is not None:
        validate_pair(target.args, args, target_source=target_source, draft_source=config_source, taps_field=taps_field)
        zlab = (config.get("architectures") or [None])[0] in BONUS_ANCHOR_ARCHITECTURES
        check_zlab_block_embedding(target, args, zlab=zlab, target_source=target_source, draft_source=config_source)
    fc = weights.get("fc.weight")
    if fc is not None and "fc.scales" not in weights and fc.shape[-1] != len(args.target_layer_ids) * args.hidden_size:
        raise ValueError(
            f"{source}: {taps_field} {list(args.target_layer_ids)} gives {len(args.target_layer_ids)} tapped layers but "
            f"fc.weight takes {fc.shape[-1] / args.hidden_size:g} x hidden_size features"
        )
    # a reduced-vocabulary draft's LM head is its own (over its rows), not a copy of the target's
    own_head = args.packaging.draft_vocab_size is not None
    shared = {k: v for k, v in weights.items() if k.startswith(SHARED_PREFIXES) and not (own_head and k.startswith("lm_head."))}
    model = fill_model(
        draft_class(args)(args), config, weights, origin,
        source=source, what="draft", dtype=checkpoint.default_dtype if dtype is None else dtype, config_name=Path(config_source).name,
    )  # fmt: skip
    return model, shared


def load(
    target: str | Path,
    draft: str | Path | None = None,
    *,
    dtype: str | mx.Dtype | None = None,
    quantize: Optional[int] = None,
    q_group_size: int = 64,
    draft_tap_ids: Optional[Sequence[int]] = None,
    draft_quantize: Optional[int] = None,
    draft_dtype: str | mx.Dtype | None = None,
    draft_vocab: Optional[int] = None,
    draft_vocab_file: str | Path | None = None,
    kv_bits: Optional[int] = None,
    tool_parser: Optional[str] = None,
    split: Optional[Callable[[Any, Path], Any]] = None,
) -> LoadedModel:
    """Load a target and optionally its DSpark draft.

    target / draft: a checkpoint directory (Hugging Face or MLX layout), a Hugging Face repo id, a
      `.gguf` file (llama.cpp: a spark2_5 / qwen3 target, a `dflash` / `dspark` draft), a directory
      holding one GGUF, or `owner/name:FILE.gguf` (downloads only that file). A GGUF target's tokenizer
      is the tokenizer.json (+ tokenizer_config.json) beside the file when there is one, else the one
      its `tokenizer.ggml.*` keys describe; its eos ids come from the GGUF.
    dtype: cast floating weights ("bfloat16", "float16", "float32"). None: as stored, except that a
      GGUF computes in its matrices' dtype (its F32 norms cast to it) and a quantized GGUF in bfloat16
      (its float16 scales rounded; see `checkpoint.gguf_compute_dtype`).
    quantize: 4 or 8 bits at load time, the layers mlx-lm would quantize (input dim a multiple of
      `q_group_size`; norms and the family's source-precision layers, e.g. spark2_5's `g_proj`, stay
      in float).
    draft_tap_ids: the target layers the draft reads, as Hugging Face layer ids (the output of layer
      i; -1 is the embedding), replacing the draft's `target_layer_ids` or its GGUF `target_layers`.
      A GGUF's `target_layers` is read as upstream llama.cpp's current converters write it, HF id + 1;
      a file from an older converter that wrote the HF ids unchanged needs this override, e.g.
      `draft_tap_ids=[2, 10, 18, 25, 33]` for the Spark-X2.6-4B draft (the ids its model card lists).
    draft_quantize: the draft's own precision: 4 or 8 bits (its layers; the parts `DRAFT_SOURCE_PRECISION`
      names for that width stay in float), 0 to keep it in float beside a `quantize`d target; None: as `quantize`.
    draft_dtype: the draft's floating dtype, replacing `dtype` for it.
    draft may also be any other draft head of the registry (models/heads/__init__.py: HEADS; docs/DRAFT_HEADS.md
      says what each loads and refuses): a file of its own is told apart by its loader's `detect` (loading/heads/)
      and built into `LoadedModel.heads[name]`; a head read from the target's own checkpoint is asked for by its
      name. Several joined by commas ("PATH,NAME" or a list), one of each kind: each round proposes from the one
      that pays more (engine/policy/head_choice.py); draft_tap_ids / draft_vocab then apply to the block draft,
      and a head they mean nothing to refuses them by name.
    draft_vocab: draft over the K most frequent target tokens only (FR-Spec; `models/heads/draft_vocab.py`),
      ranked by `draft_vocab_file` (from `python -m mlx_dspark.rank_vocab`), by default the
      `vocab_rank.json` beside the draft. Lossless: the target still verifies over its full vocabulary.
    kv_bits: 4 or 8: the target's full-attention KV caches quantized (mlx-lm's QuantizedKVCache);
      sliding layers stay in float. This changes the target's numerics (not identical to float caches).
    tool_parser: an mlx-lm tool parser (a module of `mlx_lm.tool_parsers`, e.g. "json_tools") replacing
      the one mlx-lm infers from the chat template.
    split: called as `split(target_model, target_path)` before the target's weights are read (they are lazy
      until then): the `mlx.launch` entry points split the target over their ranks there (cli/split.py), so
      each rank reads and holds its own slice only, as mlx-lm's `sharded_load` does.
    """
    drafts, own_heads = split_draft(draft)
    if own_heads and not drafts:
        for name, value in (("draft_tap_ids", draft_tap_ids), ("draft_vocab", draft_vocab), ("draft_vocab_file", draft_vocab_file)):
            if value is not None:
                head = next(iter(own_heads))
                raise ValueError(f"{name} applies to a DSpark draft, not to {head_loader(head).DESCRIPTION} (draft={head!r})")
    mx_dtype = parse_dtype(dtype)
    draft_mx_dtype = mx_dtype if draft_dtype is None else parse_dtype(draft_dtype)
    if quantize is not None:
        check_quantize_options(bits=quantize, group_size=q_group_size)
    check_draft_quantize(draft_quantize)
    if draft_quantize:
        check_quantize_options(bits=draft_quantize, group_size=q_group_size)
    check_kv_bits(kv_bits)
    for name, value in (("draft_tap_ids", draft_tap_ids), ("draft_quantize", draft_quantize), ("draft_dtype", draft_dtype),
                        ("draft_vocab", draft_vocab), ("draft_vocab_file", draft_vocab_file)):
        if value is not None and not drafts and not own_heads:
            raise ValueError(f"{name} only applies with a draft; pass draft= as well")
    if draft_vocab_file is not None and draft_vocab is None:
        raise ValueError("draft_vocab_file needs draft_vocab (K, the number of ranked tokens the draft scores)")
    target_path = resolve_path(target, role="target")
    target_checkpoint = read_checkpoint(target_path, role="target")
    target_model = build_target(target_checkpoint, dtype=mx_dtype)
    heads: dict[str, nn.Module] = {
        name: head_loader(name).build_from_target(target_checkpoint, dtype=draft_mx_dtype, **({} if arg is None else {"arg": arg}))
        for name, arg in own_heads.items()
    }  # fmt: skip
    if split is None:  # a split target is checked after the split: each rank reads its own slice only
        check_finite_weights(target_model, what=f"target ({target_path})")
    if quantize is not None and "quantization" in target_checkpoint.config:
        raise ValueError(
            f"{target_checkpoint.config_source}: the checkpoint is already quantized "
            f"({target_checkpoint.config['quantization']}); load it without quantize="
        )
    tokenizer = load_tokenizer(target_path, target_checkpoint.config, gguf_tokenizer=target_checkpoint.tokenizer,
                               tool_parser=tool_parser)

    files = read_draft_files(drafts, tap_ids=draft_tap_ids)
    # the block draft's options go to it; beside no block draft, a chained file refuses them
    block_options = {} if BLOCK_DRAFT in files else dict(draft_tap_ids=draft_tap_ids, draft_vocab=draft_vocab, draft_vocab_file=draft_vocab_file)
    draft_model = None
    for name, (_, checkpoint) in files.items():
        if name != BLOCK_DRAFT:  # each other head's own loader (the block draft's build is below)
            heads[name] = head_loader(name).build(checkpoint, target=target_model, target_source=target_checkpoint.config_source,
                                                  dtype=draft_mx_dtype, options={**block_options, "kv_bits": kv_bits, "target_tokenizer": tokenizer})  # fmt: skip
    if BLOCK_DRAFT in files:
        draft_path, draft_checkpoint = files[BLOCK_DRAFT]
        draft_model, shared = build_draft(
            draft_checkpoint, target=target_model, target_source=target_checkpoint.config_source,
            dtype=draft_mx_dtype, tap_ids=draft_tap_ids,
        )  # fmt: skip
        check_finite_weights(draft_model, what=f"draft ({draft_path})")  # before the shared copies are compared
        own_rows = check_shared_tensors(shared, target_model, draft_source=str(draft_path), storage=draft_checkpoint.storage)
        if own_rows:
            draft_model.set_embedding_rows(list(own_rows), mx.stack(list(own_rows.values())))
    head_files = {slot: (path, checkpoint.config) for slot, (path, checkpoint) in files.items()}
    # the pair's draft file: the block draft's, else the one chained draft's
    draft_path, draft_config = next((head_files[name] for name in file_heads() if name in head_files), (None, None))
    # a target head with an argument ("self:8") is a draft of its own: its cost curve is keyed by it (`head_source`)
    head_files.update({name: (target_path, {"draft": f"{name}:{arg}"}) for name, arg in own_heads.items() if arg is not None})
    target_config, target_source = target_checkpoint.config, target_checkpoint.config_source
    del target_checkpoint  # the raw (uncast, unsanitized) weights are no longer needed

    if quantize is not None:
        nn.quantize(target_model, q_group_size, quantize, class_predicate=quant_predicate(target_model, group_size=q_group_size))
    target_model.eval()
    if split is not None:
        split(target_model, target_path)
        for _, weight in tree_flatten(target_model.parameters()):  # one at a time: one whole tensor read at once
            mx.eval(weight)
        check_finite_weights(target_model, what=f"target ({target_path}), this rank's part")
    mx.eval(target_model.parameters())
    probe_target(target_model)  # our forward must give mlx-lm's own logits, or the target is refused
    if kv_bits is not None:
        check_quantized_caches(target_model, kv_bits, source=target_source)
    for name, module in heads.items():  # the heads other than the block draft, each by its own loader
        source = head_files[name][0] if name in head_files else target_path
        check_finite_weights(module, what=f"{head_loader(name).DESCRIPTION} ({source})")
        bits = quantize if draft_quantize is None else draft_quantize
        if bits:
            head_loader(name).quantize(module, bits=bits, group_size=q_group_size)
        mx.eval(module.parameters())
    if draft_model is not None:
        if draft_quantize:  # the draft's own precision: its measured source-precision parts stay in float
            predicate = quant_predicate(draft_model, group_size=q_group_size, keep=DRAFT_SOURCE_PRECISION[draft_quantize])
            nn.quantize(draft_model, q_group_size, draft_quantize, class_predicate=predicate)
        elif quantize is not None and draft_quantize is None:
            nn.quantize(draft_model, q_group_size, quantize, class_predicate=quant_predicate(draft_model, group_size=q_group_size))
        draft_model.eval()
        if draft_vocab is not None:
            if draft_model.whole_head_reason is not None:  # e.g. a selector that takes candidates from the whole head
                raise ValueError(f"{draft_path}: {draft_model.whole_head_reason}; draft_vocab / --draft-vocab applies to DSpark and DFlash drafts")
            if draft_model.args.packaging.draft_vocab_size is not None:
                raise ValueError(
                    f"{draft_path}: this draft already drafts over a reduced vocabulary of its own (d2t, "
                    f"{draft_model.args.packaging.draft_vocab_size} rows); draft_vocab / --draft-vocab applies to drafts "
                    "that share the target's LM head"
                )
            rank_file = find_rank_file(draft_vocab_file, draft_path=draft_path)
            ids = read_ranked_ids(rank_file, size=draft_vocab, vocab_size=target_model.args.vocab_size)
            draft_model.vocabulary = DraftVocabulary(ids, target=target_model, markov_head=getattr(draft_model, "markov_head", None))
        mx.eval(draft_model.parameters())
        heads[BLOCK_DRAFT] = draft_model
    heads = {name: heads[name] for name in HEADS if name in heads}  # registry order
    return LoadedModel(
        target=target_model, tokenizer=tokenizer, target_config=target_config, target_path=target_path, heads=heads,
        draft_config=draft_config, draft_path=draft_path, head_files=head_files,
    )  # fmt: skip
