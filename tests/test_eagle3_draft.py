"""EAGLE-3 drafts in vLLM speculators' layout (issue 35.3): they load (config, tensor names, d2t / t2d,
SpecForge's `midlayer.*`, the embedding copy compared), the tapped layers are EAGLE's hidden-state
indices, a chained proposal equals an independent NumPy restatement (tests/eagle3_reference.py), greedy
speculation is plain decoding token for token (attention-only and hybrid targets, with partial
acceptances rolling the draft's cache back to exactly the committed entries), sampled speculation with a
reduced draft vocabulary is the target's exact distribution, and malformed configs are refused by field."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.engine.round.decode import speculative_steps
from mlx_dspark.engine.proposers.eagle3 import Eagle3Proposer
from mlx_dspark.engine.options import SpeculationOptions
from mlx_dspark.engine.proposers.base import Proposal, Proposer
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.models.heads.eagle3.model import Eagle3Draft
from mlx_dspark.models.heads.eagle3.args import Eagle3Args
from mlx_dspark.testing.eagle3_tiny import eagle3_config, write_eagle3_draft
from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target
from tests.eagle3_reference import Eagle3Reference, LlamaTarget
from tests.engine_helpers import assert_chain_sampling_is_exact, make_target, sampled_prefix

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64, 17, 42]
FIXED = SpeculationOptions(max_draft_tokens=3)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eagle3")


@pytest.fixture(scope="module")
def llama(root) -> Path:
    return write_tiny_mlx_lm_target(root / "llama", family="llama", seed=0)


@pytest.fixture(scope="module")
def hybrid(root) -> Path:
    return write_tiny_mlx_lm_target(root / "qwen3_5", family="qwen3_5", seed=1)


@pytest.fixture(scope="module", params=["speculators", "specforge"])
def llama_pair(request, root, llama):
    """speculators' names, a llama layer, the embedding copy; SpecForge's `midlayer.*`, a qwen3 layer (q/k
    norms), no copy, norm_before_residual."""
    specforge = request.param == "specforge"
    draft = write_eagle3_draft(root / request.param, target_path=llama, seed=2, specforge_names=specforge, include_embedding=not specforge,
                               norm_before_residual=specforge, layer_type="qwen3" if specforge else "llama")  # fmt: skip
    return llama, draft, mlx_dspark.load(str(llama), draft=str(draft))


def test_the_speculators_checkpoint_loads_as_an_eagle3_draft_with_eagles_layer_numbering(llama_pair):
    from safetensors.numpy import load_file

    _, draft_dir, pair = llama_pair
    stored = load_file(str(draft_dir / "model.safetensors"))
    assert stored["d2t"].dtype == np.int64 and stored["t2d"].dtype == np.bool_ and stored["fc.weight"].shape == (128, 3 * 128)
    assert pair.draft is None and isinstance(pair.heads["eagle3"], Eagle3Draft)
    assert pair.heads["eagle3"].args.reduced_vocab and pair.heads["eagle3"].args.speculative_tokens == 3
    # EAGLE's hidden-state indices [1, 2, 3] (layer i's input) are our taps 0, 1, 2 (layer outputs)
    proposer = Eagle3Proposer(pair.heads["eagle3"], pair.target, prompt=PROMPT, greedy=True, temperature=1.0)
    assert proposer.tap_ids == (0, 1, 2) and proposer.block_size == 3
    assert Eagle3Args.from_dict({**json.loads((draft_dir / "config.json").read_text()), "eagle_aux_hidden_state_layer_ids": None}).tap_ids(32) == (1, 15, 28)


def test_a_chained_proposal_is_the_numpy_restatements_chain(llama_pair):
    assert_the_restatements_chain(*llama_pair)


LLAMA3_ROPE = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}  # fmt: skip
VARIANTS = {  # name -> (target writer, draft options); the tiny targets' 4 layers take EAGLE ids [1, 2, 3]
    "llama3-rope": ("llama", dict(rope=LLAMA3_ROPE)),  # every regime of llama3's frequency blend at original_max 64
    "narrower-draft": ("llama", dict(hidden_size=64, own_embedding=True)),  # C 64 over a C_t 128 target: its own table
    "full-vocab-no-d2t": ("llama", dict(draft_vocab_size=384, with_d2t=False)),
    "norm-before-fc": ("llama", dict(norm_before_fc=True)),  # gpt-oss drafts' input_norm over the taps
    "qwen3-target": ("qwen3", dict(layer_type="qwen3", norm_before_residual=True)),
    "default-aux-ids": ("llama8", dict(aux_layer_ids=None)),  # vLLM's (2, N // 2, N - 3) of 8 layers: taps 1, 3, 4
    "unsorted-aux-ids": ("llama", dict(aux_layer_ids=(3, 0, 2))),  # collected in layer order (vLLM's loop); 0: the embedding
}


@pytest.fixture(scope="module")
def variant_targets(root) -> dict[str, Path]:
    from mlx_dspark.testing.tiny import write_tiny_target

    return {
        "llama": write_tiny_mlx_lm_target(root / "llama", family="llama", seed=0),
        "qwen3": write_tiny_target(root / "qwen3-target", family="qwen3", seed=6),
        "llama8": write_tiny_mlx_lm_target(root / "llama8", family="llama", seed=7, num_hidden_layers=8),
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_give_the_numpy_restatements_chain(variant, variant_targets, root):
    kind, options = VARIANTS[variant]
    target_dir = variant_targets[kind]
    draft_dir = write_eagle3_draft(root / f"variant-{variant}", target_path=target_dir, seed=11, **options)
    pair = mlx_dspark.load(str(target_dir), draft=str(draft_dir))
    assert_the_restatements_chain(target_dir, draft_dir, pair)


def assert_the_restatements_chain(target_dir: Path, draft_dir: Path, pair) -> None:
    target_ref = LlamaTarget(target_dir)
    reference = Eagle3Reference(draft_dir, target_ref.embed_table)
    aux = reference.aux(target_ref.hidden_states(PROMPT), target_ref.cfg["num_hidden_layers"])
    proposer = Eagle3Proposer(pair.heads["eagle3"], pair.target, prompt=PROMPT, greedy=True, temperature=1.0, block_size=4)
    _, features = pair.target(mx.array([PROMPT]), tap_ids=proposer.tap_ids)
    assert np.abs(np.array(features[0]) - aux).max() < 1e-4 * max(1.0, np.abs(aux).max())  # the taps are EAGLE's states
    anchor = 77
    nxt = PROMPT[1:] + [anchor]
    g = reference.fuse(aux)
    ours = np.array(pair.heads["eagle3"].logits(pair.heads["eagle3"](pair.heads["eagle3"].embed(mx.array([nxt]), pair.target), pair.heads["eagle3"].fuse(features)))[0])
    expected = reference.logits(reference.outputs(nxt, g))
    finite = np.isfinite(expected)
    assert (np.isfinite(ours) == finite).all() and np.abs(ours[finite] - expected[finite]).max() < 1e-4 * np.abs(expected[finite]).max()
    proposer.extend(features)
    proposer.commit([anchor])
    proposal = proposer.propose(mx.array([anchor]), position=len(PROMPT), num_tokens=4)
    assert proposal.tokens[0].tolist() == reference.greedy_chain(nxt, g, 4)
    assert all(c.offset == len(PROMPT) for c in proposer.cache)  # the 3 chained entries were trimmed


class Injecting(Proposer):
    """The real EAGLE-3 proposer runs every round (its chain, its trims), but the block verified is the
    reference continuation with one wrong token in most rounds: partial acceptances of every length."""

    def __init__(self, inner: Eagle3Proposer, reference: list[int], prompt_len: int, vocab: int):
        self.inner, self.reference, self.prompt_len, self.vocab = inner, reference, prompt_len, vocab
        self.tap_ids, self.block_size = inner.tap_ids, inner.block_size
        self.rng = random.Random(0)

    def extend(self, features):
        self.inner.extend(features)

    def commit(self, tokens):
        self.inner.commit(tokens)

    def propose(self, anchor, *, position, num_tokens):
        mx.eval(self.inner.propose(anchor, position=position, num_tokens=num_tokens).tokens)
        start = position - self.prompt_len + 1
        tokens = list(self.reference[start : start + num_tokens])
        if self.rng.random() < 0.8:
            k = self.rng.randrange(num_tokens)
            tokens[k] = (tokens[k] + 1) % self.vocab
        return Proposal(tokens=mx.array([tokens], dtype=mx.int32))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_greedy_eagle3_speculation_is_plain_decoding_and_its_cache_rolls_back_exactly(family, root, request):
    target_dir = request.getfixturevalue("llama" if family == "llama" else "hybrid")
    draft_dir = write_eagle3_draft(root / f"draft-{family}", target_path=target_dir, seed=5)
    pair = mlx_dspark.load(str(target_dir), draft=str(draft_dir))
    plain = mlx_dspark.generate(pair, PROMPT, max_tokens=220, speculative=False).tokens
    spec = mlx_dspark.generate(pair, PROMPT, max_tokens=220, max_draft_tokens=3, lookup="off")
    assert spec.tokens == plain and len(plain) == 220 and spec.rounds > 0
    # partial acceptances of every length: the draft's cache keeps exactly the committed entries
    target, draft = pair.target, pair.heads["eagle3"]
    inner = Eagle3Proposer(draft, target, prompt=PROMPT, greedy=True, temperature=1.0)
    stats = Counter()
    proposer = Injecting(inner, plain, len(PROMPT), target.args.vocab_size)
    tokens = sampled_prefix(speculative_steps(target, proposer, PROMPT, sampler=Sampler(), speculation=FIXED), 60, stats)
    assert tokens == tuple(plain[:60]) and stats["rejected"] >= stats["rounds"] // 2 and stats["accepted"] > 10
    inner.flush()
    n, sequence = inner.entries, inner.tokens
    _, features = target(mx.array([sequence[:n]]), tap_ids=inner.tap_ids)
    fresh = draft.make_cache()
    draft(target.embed(mx.array([sequence[1 : n + 1]])), draft.fuse(features), fresh)
    for live, cold in zip(inner.cache, fresh):
        assert live.offset == cold.offset == n
        assert mx.allclose(live.keys[..., :n, :], cold.keys[..., :n, :], atol=1e-4).item()
        assert mx.allclose(live.values[..., :n, :], cold.values[..., :n, :], atol=1e-4).item()


# -- sampled: the target's exact distribution, drafting over a reduced vocabulary -------------------------

VOCAB = 8
DRAFT_ROWS = [0, 2, 3, 5, 6, 7]  # the draft never proposes 1 or 4
CHI_PROMPT = [1, 5, 2, 7, 3]
RUNS = 300
DRAWS = 1500
CHI_SAMPLER = Sampler(temperature=0.8)


@pytest.fixture(scope="module")
def tiny_vocab_pair():
    """An 8-token qwen3 target and a random EAGLE-3 draft over 6 of its tokens (d2t), built in memory."""
    from mlx.utils import tree_flatten, tree_unflatten

    target = make_target("qwen3", seed=7, vocab_size=VOCAB, layers=4)
    target.embedding.weight = target.embedding.weight * 3.0  # logits that depend on the context
    config = eagle3_config({"hidden_size": 48, "vocab_size": VOCAB}, draft_vocab_size=len(DRAFT_ROWS), aux_layer_ids=[0, 2, 3],
                           heads=4, kv_heads=2, head_dim=16, intermediate_size=96)  # fmt: skip
    draft = Eagle3Draft(Eagle3Args.from_dict(config))
    rng = np.random.default_rng(8)
    params = [(n, mx.array(rng.standard_normal(p.shape).astype(np.float32) / np.sqrt(p.shape[-1]) * (4.0 if "lm_head" in n else 1.0)))
              for n, p in tree_flatten(draft.parameters()) if n != "draft_to_target"]  # fmt: skip
    draft.update(tree_unflatten(params + [("draft_to_target", mx.array(DRAFT_ROWS, dtype=mx.int32))]))
    mx.eval(target.parameters(), draft.parameters())
    return target, draft


def test_sampled_eagle3_speculation_with_a_reduced_vocabulary_is_the_exact_target_distribution(tiny_vocab_pair):
    from tests.test_lossless_sampling import exact_distribution, marginals

    target, draft = tiny_vocab_pair
    assert marginals(exact_distribution(target, CHI_SAMPLER, 3))[:, [1, 4]].sum(-1).min() > 0.05  # the residual must give them
    make = lambda: Eagle3Proposer(draft, target, prompt=CHI_PROMPT, greedy=False, temperature=CHI_SAMPLER.temperature)  # noqa: E731
    assert_chain_sampling_is_exact(target, make, sampler=CHI_SAMPLER, speculation=FIXED, runs=RUNS, seed=13)


def test_sampled_eagle3_drafts_are_drawn_from_the_distributions_they_report(tiny_vocab_pair):
    """What sampled acceptance needs of a proposer: q over the whole vocabulary, zero outside the draft's rows,
    and each draft a draw from it (the second position's q, given the first draw, averaged over the draws)."""
    from tests.test_lossless_sampling import chi_square_p_value

    target, draft = tiny_vocab_pair
    proposer = Eagle3Proposer(draft, target, prompt=CHI_PROMPT, greedy=False, temperature=CHI_SAMPLER.temperature)
    _, features = target(mx.array([CHI_PROMPT]), tap_ids=proposer.tap_ids)
    proposer.extend(features)
    proposer.commit([4])
    first, second, q2 = np.zeros(VOCAB), np.zeros(VOCAB), np.zeros(VOCAB)
    mx.random.seed(3)
    for _ in range(DRAWS):  # the same state every time: the chained entries are trimmed after each proposal
        proposal = proposer.propose(mx.array([4]), position=len(CHI_PROMPT), num_tokens=2)
        tokens, q = proposal.tokens[0].tolist(), np.array(proposal.draft_probs[0], dtype=np.float64)
        first[tokens[0]] += 1
        second[tokens[1]] += 1
        q2 += q[1] / DRAWS
    assert q.shape == (2, VOCAB) and np.allclose(q.sum(-1), 1.0, atol=1e-5) and (q[:, [1, 4]] == 0).all()
    assert chi_square_p_value(first, q[0] / q[0].sum()) > 1e-4
    assert chi_square_p_value(second, q2 / q2.sum()) > 1e-4
    assert all(c.offset == len(CHI_PROMPT) for c in proposer.cache)


# -- refusals --------------------------------------------------------------------------------------------


def _edit(path: Path, change) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.pop("transformer_layer_config"), r"config\.json: field 'transformer_layer_config' must be an object"),
        (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), r"'transformer_layer_config\.num_hidden_layers' is 2"),
        (lambda c: c["transformer_layer_config"].update(hidden_act="gelu"), r"'transformer_layer_config\.hidden_act' is 'gelu'"),
        (lambda c: c["transformer_layer_config"].update(vocab_size=500), r"transformer_layer_config\.vocab_size is 500 but the target"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2]), r"field 'eagle_aux_hidden_state_layer_ids' must be 3 distinct"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 4]), r"eagle_aux_hidden_state_layer_ids must be distinct hidden-state indices in \[0, 3\]"),
        (lambda c: c.pop("eagle_aux_hidden_state_layer_ids"), r"absent: vLLM's default \[2, 2, 1\]"),
        (lambda c: c.update(draft_vocab_size=1000), r"field 'draft_vocab_size' 1000 exceeds"),
        (lambda c: c.update(draft_vocab_size="many"), r"field 'draft_vocab_size' must be an integer"),
        (lambda c: c["speculators_config"].update(proposal_methods=[{"speculative_tokens": 0}]), r"speculative_tokens' must be an integer >= 1"),
        (lambda c: c.update(norm_before_fc=True), r"missing tensor\(s\) \['input_norm\.weight'\]"),
    ],
)
def test_a_malformed_config_is_refused_naming_the_file_and_field(change, message, llama, tmp_path):
    draft = write_eagle3_draft(tmp_path / "draft", target_path=llama, seed=3)
    _edit(draft, change)
    with pytest.raises(ValueError, match=message):
        mlx_dspark.load(str(llama), draft=str(draft))


def test_what_an_eagle3_draft_cannot_do_is_one_clear_line(llama, tmp_path):
    from safetensors.numpy import load_file, save_file

    from mlx_dspark.models.packed.forward import packing_problem

    draft = write_eagle3_draft(tmp_path / "draft", target_path=llama, seed=3)
    with pytest.raises(ValueError, match=r"draft_vocab applies to DSpark drafts; this is an EAGLE-3 draft"):
        mlx_dspark.load(str(llama), draft=str(draft), draft_vocab=64)
    with pytest.raises(ValueError, match=r"this is an EAGLE-3 draft, not a target"):
        mlx_dspark.load(str(draft))
    assert packing_problem(mlx_dspark.load(str(llama), draft=str(draft))) is None  # it batches (tests/test_batch_heads.py)
    weights = load_file(str(draft / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "d2t"}, str(draft / "model.safetensors"))
    with pytest.raises(ValueError, match=r"draft_vocab_size 128 is below the target's vocabulary \(384\) but the weights hold no 'd2t'"):
        mlx_dspark.load(str(llama), draft=str(draft))
    save_file({**weights, "embed_tokens.weight": weights["embed_tokens.weight"] + 1.0}, str(draft / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'embed_tokens\.weight' differs from the target's embed weights"):
        mlx_dspark.load(str(llama), draft=str(draft))
    with pytest.raises(ValueError, match=r"an EAGLE-3 draft is not converted"):
        from mlx_dspark.loading.convert import convert

        convert(draft, tmp_path / "converted", log=lambda _: None)


def test_generate_cli_with_an_eagle3_draft_is_plain_decodings_output(llama, tmp_path):
    import os
    import subprocess
    import sys

    draft = write_eagle3_draft(tmp_path / "draft", target_path=llama, seed=4)
    env = {**os.environ, "MLX_DSPARK_COST_DIR": str(tmp_path / "costs")}
    runs = {}
    for name, flags in (("eagle3", ["--draft", str(draft), "--max-draft-tokens", "3"]), ("plain", ["--no-draft"])):
        proc = subprocess.run([sys.executable, "-m", "mlx_dspark.generate", "--model", str(llama), *flags, "--prompt", "Hello",
                               "--max-tokens", "24", "--json"], capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["eagle3"]["speculative"] is True and runs["eagle3"]["acceptance_lengths"]
    assert runs["eagle3"]["tokens"] == runs["plain"]["tokens"]
