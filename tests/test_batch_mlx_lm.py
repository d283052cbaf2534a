"""Continuous batching over targets run through mlx-lm's own model class (models/packed/mlx_lm.py).

Every packed row must be bitwise its sequence's own forward (logits and tapped features), also after a
rollback of a packed verify (rotating sliding-window caches past their wrap, recurrent states restored
and their layer replayed); a batched greedy run with injected wrong drafts (partial acceptances: each row
rolls back on its own) must equal each request's solo run and mlx-lm's own generate; the server batches
such targets, hybrids included, and refuses in one line a family it cannot split.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_map, tree_unflatten
from mlx_lm.models import gemma2 as mlx_lm_gemma2
from mlx_lm.models import qwen3 as mlx_lm_qwen3

import mlx_dspark
from mlx_dspark.bench.controlled import reference_block
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.batch.round import BatchRow, batch_round
from mlx_dspark.engine.batch.length import row_budget_cap
from mlx_dspark.engine.options import GenerationOptions, SpeculationOptions
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.proposers.base import Proposal
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.models.target import mlx_lm as mlx_lm_target
from mlx_dspark.models.caches.kv import trim_caches
from mlx_dspark.models.packed.forward import packed_block_hidden, packed_target_forward, packing_problem
from mlx_dspark.testing.draft_layouts import write_gemma4_draft
from mlx_dspark.testing.mlx_lm_checkpoints import HYBRID_FAMILIES, tiny_mlx_lm_config, tiny_mlx_lm_weights, write_draft_for, write_tiny_mlx_lm_target
from mlx_dspark.testing.mtp_deepseek_tiny import write_tiny_nextn_target
from mlx_dspark.testing.tiny import write_tiny_draft
from mlx_dspark.testing.mlx_lm_models import tiny_mlx_lm_model
from tests.test_mlx_lm_targets import mlx_lm_greedy

SMALL_WINDOW = {"gemma4_text": {"sliding_window": 6}}  # the sliding layers' rotating caches wrap within the test


def _as_target(model):
    """Our target over a tiny mlx-lm model built from its args (its weights moved over)."""
    target = mlx_lm_target.target_class(type(model))(model.args)
    target.update(model.parameters())
    mlx_lm_target.probe_target(target)
    return target


def _qwen3_through_mlx_lm():
    mx.random.seed(3)
    args = mlx_lm_qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
        rms_norm_eps=1e-6, vocab_size=97, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
        head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    model = mlx_lm_qwen3.Model(args)
    model.update(tree_map(lambda w: mx.random.normal(w.shape) * 2 / w.shape[-1] ** 0.5 if w.ndim == 2 else w, model.parameters()))
    return _as_target(model)


def _from_tiny_config(family):
    config = tiny_mlx_lm_config(family, {"bos": 1, "eos": 2, "pad": 0})
    target = mlx_lm_target.from_config(config)
    weights = target.sanitize({k: mx.array(v) for k, v in tiny_mlx_lm_weights(config, seed=0).items()})
    target.update(tree_unflatten(list(weights.items())))
    mlx_lm_target.probe_target(target)
    return target


TARGETS = {
    "qwen3_moe": lambda: _from_tiny_config("qwen3_moe"),
    "llama": lambda: _as_target(tiny_mlx_lm_model("llama_quantized")),  # llama's own caches (KVCache)
    "qwen3": _qwen3_through_mlx_lm,
    "gemma3_text": lambda: _as_target(tiny_mlx_lm_model("gemma3_text")),  # RotatingKVCache (window 5) + KVCache
    "gemma4_text": lambda: _as_target(tiny_mlx_lm_model("gemma4_text")),  # the same, KV-shared layers, per-layer inputs, MoE
    # recurrent layers (run once per sequence inside the packed forward, replayed on rollback)
    "qwen3_5": lambda: _as_target(tiny_mlx_lm_model("qwen3_5")),  # GatedDeltaNet ArraysCache + KVCache
    "lfm2": lambda: _as_target(tiny_mlx_lm_model("lfm2")),  # short-conv ArraysCache + KVCache
    "nemotron_h": lambda: _as_target(tiny_mlx_lm_model("nemotron_h")),  # Mamba-2 + attention + MLP / MoE blocks
    "falcon_h1": lambda: _as_target(tiny_mlx_lm_model("falcon_h1")),  # CacheList(ArraysCache, KVCache) per layer
    "mamba2": lambda: _as_target(tiny_mlx_lm_model("mamba2")),  # recurrent only: no attention at all
    # attention written out (its own arithmetic on the mask / keys): the attention module per sequence
    "gemma2": lambda: _gemma2(),
}


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_packed_rows_are_bitwise_their_own_forward_and_roll_back_alike(family):
    """3 sequences at different offsets, segments of 1, 4 and a 40-row prefill chunk, then each rolls back
    its own number of rows (a verify's rejected tail) and the next packed forward still equals the solo one."""
    target = TARGETS[family]()
    assert packing_problem(type("Pair", (), {"target": target, "draft": None, "heads": {}})()) is None
    if family in ("qwen3_5", "lfm2", "nemotron_h", "falcon_h1", "mamba2"):  # only the mixer per sequence
        assert target._dspark_split_mode == "module"
    if family == "gemma2":
        assert target._dspark_split_mode == "attention"
    check_packed_rows(target)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_next_n_targets_packed_rows_are_bitwise_their_own_forward(family, tmp_path):
    """DeepSeek-V3's MLA attention scores the rotary part itself and hands the sum as the mask: its attention
    runs per sequence; GLM-4.5's calls mlx-lm's attention and packs as any other family."""
    target = mlx_dspark.load(str(write_tiny_nextn_target(tmp_path / family, family=family, seed=0))).target
    assert packing_problem(type("Pair", (), {"target": target, "draft": None, "heads": {}})()) is None
    assert target._dspark_split_mode == ("attention" if family == "deepseek_v3" else "module")
    check_packed_rows(target)


@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1"])
def test_whole_recurrent_layers_per_sequence_are_bitwise_too(family):
    """The fallback for a family whose layer does more with its recurrent cache or mask than hand them to
    one sub-module: the whole layer runs per sequence (chosen at load when the probe of the default fails)."""
    target = TARGETS[family]()
    object.__setattr__(target, "_dspark_split_mode", "layer")
    check_packed_rows(target)


def check_packed_rows(target):
    vocab, taps = target.args.vocab_size, (-1, 0)
    prompts = [list(range(5, 12)), list(range(20, 29)), [3, 4, 5]]
    segments = [[7], [8, 9, 10, 11], [(40 + i) % vocab for i in range(40)]]  # 45 rows: MoE experts sort them
    rejected = [0, 3, 2]
    after = [[9, 10, 11], [12], [5, 6]]
    solo, caches = [], []
    for prompt, segment, n, more in zip(prompts, segments, rejected, after):
        cache = target.make_cache()
        target(mx.array(prompt)[None], cache=cache)
        logits, features = target(mx.array(segment)[None], cache=cache, tap_ids=taps)
        trim_caches(cache, n)
        later, _ = target(mx.array(more)[None], cache=cache)
        solo.append((logits[0], features[0], later[0]))
        packed = target.make_cache()
        target(mx.array(prompt)[None], cache=packed)
        caches.append(packed)
    tokens = [t for s in segments for t in s]
    logits, features = packed_target_forward(target, tokens, caches, [len(s) for s in segments], tap_ids=taps)
    for cache, n in zip(caches, rejected):
        trim_caches(cache, n)
    later, _ = packed_target_forward(target, [t for m in after for t in m], caches, [len(m) for m in after])
    start = start_later = 0
    for i, ((solo_logits, solo_features, solo_later), segment, more) in enumerate(zip(solo, segments, after)):
        rows, rows_later = slice(start, start + len(segment)), slice(start_later, start_later + len(more))
        assert mx.array_equal(logits[rows], solo_logits).item(), f"sequence {i}: logits"
        assert mx.array_equal(features[rows], solo_features).item(), f"sequence {i}: features"
        assert mx.array_equal(later[rows_later], solo_later).item(), f"sequence {i}: after its rollback"
        start, start_later = start + len(segment), start_later + len(more)
    head_rows = [0, 4, 44]  # only the rows a round needs: the same logits
    fresh = []
    for prompt in prompts:
        fresh.append(target.make_cache())
        target(mx.array(prompt)[None], cache=fresh[-1])
    only, _ = packed_target_forward(target, tokens, fresh, [len(s) for s in segments], head_rows=head_rows)
    assert mx.array_equal(only, logits[mx.array(head_rows)]).item()


def write_pair(root: Path, family: str, *, draft_family: str = "qwen3") -> tuple[Path, Path]:
    target = write_tiny_mlx_lm_target(root / "target", family=family, seed=0, **SMALL_WINDOW.get(family, {}))
    if draft_family == "gemma4":  # DeepSpec's Gemma 4 draft layers
        return target, write_gemma4_draft(root / "draft", target_path=target, seed=1)
    if family in HYBRID_FAMILIES:  # mlx-lm's layout (a multimodal wrapper's text fields for qwen3_5)
        return target, write_draft_for(root / "draft", target_path=target)
    draft = write_tiny_draft(root / "draft", target_path=target, layer_family="qwen3", seed=0)
    config = json.loads((draft / "config.json").read_text())
    config.update(rope_theta=10000.0, rope_parameters=None)  # the draft's own layers: default RoPE
    config.pop("final_logit_softcapping", None)
    (draft / "config.json").write_text(json.dumps(config))
    return target, draft


class RevisingProposer(DraftProposer):
    """The real (packed) draft forward, its proposal replaced by the reference continuation with one wrong
    token in most rounds: partial acceptances, so every row rolls back on its own."""

    def __init__(self, model, *, context, reference, prompt_len, seed):
        super().__init__(model.draft, model.target, greedy=True, temperature=1.0, context=context)
        self.reference, self.prompt_len, self.vocab, self.seed = reference, prompt_len, model.target.args.vocab_size, seed

    def revise(self, proposal, *, position, num_tokens):
        self.seed = (self.seed * 1103515245 + 12345) % 2**31
        wrong = self.seed % num_tokens if self.seed % 7 else None
        return Proposal(tokens=reference_block(proposal, self.reference, start=position - self.prompt_len + 1,
                                               num_tokens=num_tokens, wrong=wrong, vocab_size=self.vocab))  # fmt: skip


@pytest.mark.parametrize("family", ["gemma4_text", "llama", "qwen3_moe", "qwen3_5", "lfm2", "nemotron_h"])
def test_batched_greedy_rows_equal_solo_runs_and_mlx_lms_generate(family, tmp_path):
    target_path, draft_path = write_pair(tmp_path, family)
    model = prepare_model(mlx_dspark.load(str(target_path), str(draft_path)), RunSettings(ignore_eos=True))
    check_batched_rows(model, target_path)


def check_batched_rows(model, target_path: Path) -> None:
    """Four requests (one joining later, one plain) batched with injected wrong drafts: each row's tokens are
    mlx-lm's own generate and its solo run, and the drafting rows rolled back partial acceptances."""
    assert packing_problem(model) is None
    prompts = [[1, 5, 9, 20, 33, 7], list(range(40, 71)), [9, 8, 7, 6, 5, 4, 3, 2, 1] * 2, [100, 101, 102]]
    lengths, joins = [30, 18, 24, 20], [0, 0, 0, 3]  # the last one joins while the others run
    rows, want = [], []
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        reference = mlx_lm_greedy(target_path, prompt, n + 8)
        options = GenerationOptions(max_tokens=n, speculation=SpeculationOptions(max_draft_tokens=4) if i != 2 else SpeculationOptions(speculative=False))
        cache = PromptCache(model.target, model.draft, max_snapshots=0)
        proposer = None if i == 2 else RevisingProposer(model, context=cache.draft_context, reference=reference, prompt_len=len(prompt), seed=i + 1)
        rows.append(lambda p=prompt, o=options, c=cache, q=proposer: BatchRow(model, p, o, prompt_cache=c, proposer=q))
        want.append((reference[:n], prompt, options))
    active, done, round_no = {}, {}, 0
    while len(done) < len(rows):
        for i, make in enumerate(rows):
            if joins[i] == round_no:
                active[i] = make()
        batch_round(model, list(active.values()), draft_cap=row_budget_cap(12), prefill_chunk=8)
        for i, row in list(active.items()):
            if row.emitted >= row.options.max_tokens:
                done[i] = row
                del active[i]
        round_no += 1
    for i, (reference, prompt, options) in enumerate(want):
        row = done[i]
        tokens = [t for r in row.rounds for t in r.tokens][: options.max_tokens]
        assert tokens == reference, f"request {i}: mlx-lm's generate"
        solo = mlx_dspark.generate(model, prompt, options=GenerationOptions(max_tokens=options.max_tokens, speculation=SpeculationOptions(speculative=False)))
        assert tokens == solo.tokens, f"request {i}: solo run"
        if i != 2:
            assert 0 < row.accepted < row.proposed, f"request {i}: partial acceptances (rollbacks) were exercised"


def test_a_gemma4_pair_batches_its_draft_block_bitwise_and_its_rows_equal_mlx_lm(tmp_path):
    """DeepSpec's Gemma 4 draft layers (sandwich norms, layer scalar, sqrt(hidden) embeddings, proportional
    RoPE) in the packed draft block: each sequence's block is bitwise its own `block_hidden`, and batched
    greedy rows drafted by it (real proposals) equal mlx-lm's own generate."""
    target_path, draft_path = write_pair(tmp_path, "gemma4_text", draft_family="gemma4")
    model = prepare_model(mlx_dspark.load(str(target_path), str(draft_path)), RunSettings(ignore_eos=True))
    target, draft = model.target, model.draft
    assert draft.args.family == "gemma4" and packing_problem(model) is None
    prompts = [[1, 5, 9, 20, 33, 7, 2], list(range(40, 59)), [9, 8, 7, 6]]
    contexts = []
    for prompt in prompts:
        _, features = target(mx.array(prompt)[None], cache=target.make_cache(), tap_ids=draft.args.target_layer_ids)
        contexts.append(draft.make_cache())
        draft.append_context(features, contexts[-1])
    anchors = mx.array([3, 4, 5], dtype=mx.int32)
    block = packed_block_hidden(draft, anchors, contexts, target=target)
    for i, ctx in enumerate(contexts):
        assert mx.array_equal(block[i : i + 1], draft.block_hidden(anchors[i : i + 1], ctx, target=target)).item(), f"sequence {i}"
    lengths = [24, 16, 20]
    rows = [BatchRow(model, p, GenerationOptions(max_tokens=n, speculation=SpeculationOptions(max_draft_tokens=4))) for p, n in zip(prompts, lengths)]
    while any(row.emitted < row.options.max_tokens for row in rows):
        batch_round(model, [r for r in rows if r.emitted < r.options.max_tokens], draft_cap=row_budget_cap(12), prefill_chunk=8)
    for row, prompt, n in zip(rows, prompts, lengths):
        assert [t for r in row.rounds for t in r.tokens][:n] == mlx_lm_greedy(target_path, prompt, n)
    assert sum(row.proposed for row in rows) > 0


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_server_batches_an_mlx_lm_target(family, tmp_path):
    from tests.test_server import call, pair_loader, running_server

    pair = write_pair(tmp_path, family)
    with running_server(pair_loader(pair), max_batch=3, batch_draft_cap=lambda width: 3, batch_prefill_chunk=8) as server:
        assert server.worker.load_error is None and server.worker.model is not None
        model = server.worker.model
        prompts = [("Once upon", 14), ("def f(x):", 9), ("1 2 3 4 5 6 7", 12)]
        results = {}
        gate = threading.Barrier(len(prompts))

        def run(i, prompt, n):
            gate.wait()
            results[i] = call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0})

        threads = [threading.Thread(target=run, args=(i, *p)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, (prompt, n) in enumerate(prompts):
            status, _, reply = results[i]
            assert status == 200, reply
            assert reply["choices"][0]["text"] == mlx_dspark.generate(model, prompt, max_tokens=n).text
        assert server.worker.peak_active >= 2, "the requests did share rounds"


def _gemma2(model_class=None):
    """gemma2 writes its attention out (soft-capped scores) instead of calling mlx-lm's
    scaled_dot_product_attention: a packed forward runs its attention module per sequence."""
    config = dict(model_type="gemma2", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                  head_dim=16, rms_norm_eps=1e-6, vocab_size=384, num_key_value_heads=2)  # fmt: skip
    target = mlx_lm_target.from_config(config, model_class=model_class)
    mx.eval(target.parameters())
    mlx_lm_target.probe_target(target)  # a valid target: one request at a time runs it
    return target


class _IntOffsetBackbone(mlx_lm_gemma2.GemmaModel):
    """gemma2's backbone reading its first cache's offset as an int, outside any layer (as gpt_bigcode's
    position ids do): no layer split can serve that."""

    def __call__(self, inputs, cache=None, **kwargs):
        if cache is not None:
            inputs = inputs + 0 * int(cache[0].offset)
        return super().__call__(inputs, cache, **kwargs)


class _IntOffsetGemma2(mlx_lm_gemma2.Model):
    def __init__(self, args):
        super().__init__(args)
        self.model = _IntOffsetBackbone(args)


def test_a_family_that_cannot_be_split_is_refused_in_one_line(tmp_path):
    problem = packing_problem(type("Pair", (), {"target": _gemma2(_IntOffsetGemma2), "draft": None, "heads": {}})())
    assert problem.startswith("the target (model_type 'gemma2') fails in a packed forward") and "scaled_dot_product_attention" in problem
    assert "; with its attention per sequence it fails in a packed forward (ValueError: " in problem
    assert "\n" not in problem
    from tests.test_server import call, running_server

    target_path, _ = write_pair(tmp_path, "llama")
    loaded = dataclasses.replace(mlx_dspark.load(str(target_path)), target=_gemma2(_IntOffsetGemma2))
    with running_server(lambda: loaded, max_batch=4) as server:
        server.worker.loaded.wait(60)
        status, _, health = call(server, "GET", "/health")
    error = server.worker.load_error
    assert error == f"--max-batch 4: {problem}; serve it with --max-batch 1"
    assert status != 200 or health.get("status") != "ok", health
