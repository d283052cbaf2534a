"""Exporting the new draft heads (issue 35.5): DFlash 2 to llama.cpp's `dflash` GGUF with the DFlash 2 keys
and to z-lab's Hugging Face layout, DFlash (v1) to GGUF and DeepSpec's layout drafting from row 1, EAGLE-3 to
vLLM speculators' layout; each read back by our loader is the same draft (parameters bitwise, proposals
equal). A format that cannot hold the draft, llama.cpp's top-K check, and the target's MTP layers are
refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

import mlx_dspark
from mlx_dspark.export.write import export_draft
from mlx_dspark.testing.dflash2_tiny import write_dflash2_draft
from mlx_dspark.testing.draft_layouts import repackage
from mlx_dspark.testing.tiny import write_tiny_draft

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64, 17, 42, 8, 91, 4, 66, 120, 2, 19, 300]  # longer than the window (16)


def _params(model) -> dict[str, np.ndarray]:
    """Exact values (bfloat16 as its bits: numpy has no bfloat16)."""
    return {k: np.array(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v) for k, v in tree_flatten(model.parameters())}


def _block_proposals(pair) -> list[list[int]]:
    """Greedy proposals of a block draft after the prompt, from three anchors."""
    target, draft = pair.target, pair.draft
    _, features = target(mx.array([PROMPT]), tap_ids=tuple(draft.args.target_layer_ids))
    ctx = draft.make_cache()
    draft.append_context(features, ctx)
    out = []
    for anchor in (17, 250, 3):
        proposal = draft.propose(mx.array([anchor]), ctx, target=target)
        out.append((proposal.tokens[0].tolist(), np.array(proposal.token_probs)))
    return out


def _assert_same_block_draft(target: Path, source: Path, exported: Path, *, dtype: str = "float32") -> None:
    a = mlx_dspark.load(str(target), draft=str(source), dtype=dtype)
    b = mlx_dspark.load(str(target), draft=str(exported), dtype=dtype)
    pa, pb = _params(a.draft), _params(b.draft)
    assert sorted(pa) == sorted(pb)
    for name in pa:
        assert pa[name].dtype == pb[name].dtype and np.array_equal(pa[name], pb[name]), name
    assert a.draft.args.dflash2 == b.draft.args.dflash2 and a.draft.args.packaging == b.draft.args.packaging
    for field in ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "enable_confidence_head", "layer_types"):
        assert getattr(a.draft.args, field) == getattr(b.draft.args, field), field
    for (tokens_a, probs_a), (tokens_b, probs_b) in zip(_block_proposals(a), _block_proposals(b)):
        assert tokens_a == tokens_b and np.array_equal(probs_a, probs_b)


@pytest.fixture(scope="module")
def dflash2_drafts(tiny_qwen3_target, tmp_path_factory):
    """z-lab DFlash 2 drafts: K = 3 (so a conv base's ggml shape {C, K, 2} is told apart), one plain, one
    with output_multiplier and a softcap (the GGUF's logit_scale / final_logit_softcapping)."""
    root = tmp_path_factory.mktemp("export-dflash2")
    deepspec = write_tiny_draft(root / "deepspec", target_path=tiny_qwen3_target, seed=3)
    plain = write_dflash2_draft(deepspec, root / "plain", seed=4, kernel_size=3)
    scaled = write_dflash2_draft(deepspec, root / "scaled", seed=5, kernel_size=3, output_multiplier=0.7, softcap=20.0)
    return {"plain": plain, "scaled": scaled}


@pytest.mark.parametrize(("kind", "bf16"), [("plain", False), ("scaled", False), ("plain", True)])
def test_a_dflash2_gguf_export_reads_back_as_the_same_draft(kind, bf16, dflash2_drafts, tiny_qwen3_target, tmp_path):
    """With --bf16 the matrices (3-D conv bases and codebooks too) are BF16: the same draft in bfloat16."""
    source = dflash2_drafts[kind]
    out = tmp_path / "dflash2.gguf"
    export_draft(source, out, to="gguf", target=tiny_qwen3_target, bf16=bf16)
    _assert_same_block_draft(tiny_qwen3_target, source, out, dtype="bfloat16" if bf16 else "float32")


def test_the_dflash2_gguf_has_llama_cpps_keys_and_tensor_shapes(dflash2_drafts, tiny_qwen3_target, tmp_path):
    """DRAFTERS.md section 1, restated: the four dflash.* keys, blk.N.{attn,ffn}_conv_base ggml {C, K, 2}
    (no suffix), conv_proj {C, 2KC/G}, the selector's three tensors; no Markov or confidence tensors, and
    the block drafts from row 1 (sample_from_anchor false, as upstream runs a file without markov_w1)."""
    from gguf import GGUFReader

    source = dflash2_drafts["scaled"]
    config = json.loads((source / "config.json").read_text())
    C, K, G, rank, V = config["hidden_size"], 3, 16, 8, config["vocab_size"]
    out = tmp_path / "d.gguf"
    export_draft(source, out, to="gguf", target=tiny_qwen3_target)
    reader = GGUFReader(out)
    keys = {k: f.contents() for k, f in reader.fields.items() if k.startswith("dflash.")}
    assert {k: keys[k] for k in ("dflash.conv_kernel_size", "dflash.conv_group_size", "dflash.selector_rank", "dflash.selector_top_k")} == {
        "dflash.conv_kernel_size": K, "dflash.conv_group_size": G, "dflash.selector_rank": rank, "dflash.selector_top_k": 4}  # fmt: skip
    assert keys["dflash.logit_scale"] == pytest.approx(0.7) and keys["dflash.final_logit_softcapping"] == 20.0
    assert keys["dflash.sample_from_anchor"] is False and keys["dflash.has_confidence_head"] is False
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}  # ggml order (ne)
    for i in range(config["num_hidden_layers"]):
        for side in ("attn", "ffn"):
            assert shapes[f"blk.{i}.{side}_conv_base"] == [C, K, 2]
            assert shapes[f"blk.{i}.{side}_conv_proj.weight"] == [C, 2 * K * C // G]
    assert shapes["selector_hidden.weight"] == [C, rank]
    assert shapes["selector_predecessor.weight"] == shapes["selector_successor.weight"] == [rank, V]
    assert not any(n.startswith(("markov_", "conf_proj", "token_embd", "output.")) for n in shapes)
    base = load_file(str(source / "model.safetensors"))["layers.1.mlp_conv.base_kernel"]  # (2, K, C): no permute
    stored = next(t for t in reader.tensors if t.name == "blk.1.ffn_conv_base")
    assert np.array_equal(np.asarray(stored.data).reshape(base.shape), base)


def test_a_dflash2_draft_exports_to_zlabs_layout_from_its_files_and_from_its_gguf(dflash2_drafts, tiny_qwen3_target, tmp_path):
    source = dflash2_drafts["scaled"]
    export_draft(source, tmp_path / "d.gguf", to="gguf", target=tiny_qwen3_target)
    for origin in (source, tmp_path / "d.gguf"):
        out = tmp_path / f"zlab-{origin.name}"
        notes = export_draft(origin, out, to="zlab")
        assert any("target's embedding and LM head" in n for n in notes)
        _assert_same_block_draft(tiny_qwen3_target, source, out)
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3" and config["is_causal"] is False
        assert config["dflash_config"] == {
            "block_size": 7, "conv_group_size": 16, "conv_kernel_size": 3, "final_logit_softcapping": 20.0,
            "mask_token_id": config["dflash_config"]["mask_token_id"], "output_multiplier": 0.7, "selector_rank": 8,
            "selector_top_k": 4, "target_layer_ids": json.loads((source / "config.json").read_text())["dflash_config"]["target_layer_ids"],
        }  # fmt: skip
        assert not any(k in config for k in ("markov_rank", "enable_confidence_head", "sample_from_anchor"))
        assert sorted(load_file(str(out / "model.safetensors"))) == sorted(load_file(str(source / "model.safetensors")))


def test_formats_that_cannot_hold_a_dflash2_draft_and_llama_cpps_top_k_check_are_one_line(dflash2_drafts, tiny_qwen3_target, tmp_path):
    source = dflash2_drafts["plain"]
    with pytest.raises(ValueError, match=r"a DFlash 2 draft does not fit --to deepspec; export it --to gguf or --to zlab"):
        export_draft(source, tmp_path / "ds", to="deepspec", target=tiny_qwen3_target)
    assert not (tmp_path / "ds").exists()
    # hidden 128: top-K 11 needs 11 * 12 = 132 (llama.cpp refuses the file); z-lab's layout holds it
    deepspec = write_tiny_draft(tmp_path / "deepspec", target_path=tiny_qwen3_target, seed=3)
    wide = write_dflash2_draft(deepspec, tmp_path / "wide", seed=4, top_k=11)
    with pytest.raises(ValueError, match=r"selector_top_k 11 needs hidden_size >= top_k \* \(top_k \+ 1\) = 132 .* has 128: export it --to zlab"):
        export_draft(wide, tmp_path / "wide.gguf", to="gguf", target=tiny_qwen3_target)
    assert not (tmp_path / "wide.gguf").exists()
    export_draft(wide, tmp_path / "wide-zlab", to="zlab")
    _assert_same_block_draft(tiny_qwen3_target, wide, tmp_path / "wide-zlab")


@pytest.mark.parametrize("packaging", ["zlab_dflash", "speculators_dflash_markov"])
@pytest.mark.parametrize("to", ["gguf", "deepspec"])
def test_a_draft_that_drafts_from_row_1_keeps_doing_so_when_exported(packaging, to, tiny_qwen3_pair, tmp_path):
    """z-lab's DFlash (no Markov head) and a speculators DSpark draft with sample_from_anchor false: the
    export says so (GGUF `sample_from_anchor` false, DeepSpec's config field), so the same tokens come back."""
    target, draft = tiny_qwen3_pair
    source = repackage(draft, tmp_path / packaging, packaging)
    out = tmp_path / ("d.gguf" if to == "gguf" else "deepspec")
    export_draft(source, out, to=to, target=target)
    _assert_same_block_draft(target, source, out)
    assert mlx_dspark.load(str(target), draft=str(out)).draft.args.packaging.first_draft_row == 1


def test_a_drafts_packaging_scales_are_carried_by_both_formats(tiny_qwen3_pair, dflash2_drafts, tmp_path):
    """attention_value_scale, attention_scale, input_embedding_scale and markov_w2_scale (a published
    packaging's, models/heads/dspark/packaging.py) become the GGUF's keys and `markov_w2.scale` tensor; a DFlash 2
    draft's input_embedding_scale goes under z-lab's dflash_config."""
    import shutil

    target, draft = tiny_qwen3_pair
    scaled = Path(shutil.copytree(draft, tmp_path / "scaled"))
    config = json.loads((scaled / "config.json").read_text())
    config.update(attention_value_scale=0.5, attention_scale=0.2, input_embedding_scale=2.0, markov_w2_scale=0.7)
    (scaled / "config.json").write_text(json.dumps(config))
    for to in ("gguf", "deepspec"):
        out = tmp_path / ("d.gguf" if to == "gguf" else "deepspec")
        export_draft(scaled, out, to=to, target=target)
        _assert_same_block_draft(target, scaled, out)
    dflash2 = Path(shutil.copytree(dflash2_drafts["plain"], tmp_path / "dflash2"))
    config = json.loads((dflash2 / "config.json").read_text())
    config["dflash_config"]["input_embedding_scale"] = 2.0
    (dflash2 / "config.json").write_text(json.dumps(config))
    for to in ("gguf", "zlab"):
        out = tmp_path / ("d2.gguf" if to == "gguf" else "zlab")
        export_draft(dflash2, out, to=to, target=target)
        _assert_same_block_draft(target, dflash2, out)


# -- EAGLE-3 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory) -> Path:
    from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target

    return write_tiny_mlx_lm_target(tmp_path_factory.mktemp("export-eagle3") / "llama", family="llama", seed=0)


def _chain(pair) -> list[int]:
    from mlx_dspark.engine.proposers.eagle3 import Eagle3Proposer

    proposer = Eagle3Proposer(pair.heads["eagle3"], pair.target, prompt=PROMPT, greedy=True, temperature=1.0, block_size=4)
    _, features = pair.target(mx.array([PROMPT]), tap_ids=proposer.tap_ids)
    proposer.extend(features)
    proposer.commit([77])
    return proposer.propose(mx.array([77]), position=len(PROMPT), num_tokens=4).tokens[0].tolist()


@pytest.mark.parametrize("names", ["speculators", "specforge"])
def test_an_eagle3_draft_exports_to_speculators_layout_and_reads_back_the_same(names, llama_target, tmp_path):
    """speculators' names with the embedding copy; SpecForge's `midlayer.*` without one (a qwen3 layer,
    norm_before_residual), exported once alone and once with --target (which adds the copy)."""
    from mlx_dspark.testing.eagle3_tiny import write_eagle3_draft

    specforge = names == "specforge"
    source = write_eagle3_draft(tmp_path / "source", target_path=llama_target, seed=2, specforge_names=specforge,
                                include_embedding=not specforge, norm_before_residual=specforge,
                                layer_type="qwen3" if specforge else "llama")  # fmt: skip
    stored = load_file(str(source / "model.safetensors"))
    a = mlx_dspark.load(str(llama_target), draft=str(source))
    for target in (None, llama_target):
        out = tmp_path / f"out-{target is not None}"
        notes = export_draft(source, out, to="speculators", target=target)
        assert any("no copy of the target's embedding" in n for n in notes) == (specforge and target is None)
        written = load_file(str(out / "model.safetensors"))
        assert not any(k.startswith("midlayer.") for k in written) and "layers.0.self_attn.q_proj.weight" in written
        assert written["d2t"].dtype == np.int64 and np.array_equal(written["d2t"], stored["d2t"])
        assert written["t2d"].dtype == np.bool_ and np.array_equal(written["t2d"], stored["t2d"])
        assert ("embed_tokens.weight" in written) == (not specforge or target is not None)
        assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
        b = mlx_dspark.load(str(llama_target), draft=str(out))
        pa, pb = _params(a.heads["eagle3"]), _params(b.heads["eagle3"])
        assert sorted(pa) == sorted(pb) and all(np.array_equal(pa[k], pb[k]) for k in pa)
        assert a.heads["eagle3"].args == b.heads["eagle3"].args
        assert _chain(a) == _chain(b)


def test_an_eagle3_draft_is_refused_by_the_other_formats_in_one_line(llama_target, tmp_path):
    from mlx_dspark.testing.eagle3_tiny import write_eagle3_draft

    source = write_eagle3_draft(tmp_path / "source", target_path=llama_target, seed=2)
    for to in ("gguf", "deepspec", "zlab"):
        out = tmp_path / ("d.gguf" if to == "gguf" else to)
        with pytest.raises(ValueError, match=rf"an EAGLE-3 draft does not fit --to {to}; export it --to speculators$"):
            export_draft(source, out, to=to)
        assert not out.exists()
    # --force over an earlier export: a refused one leaves it as it was
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="does not fit --to deepspec"):
        export_draft(source, tmp_path / "old", to="deepspec", force=True)
    assert (tmp_path / "old" / "config.json").read_text() == "{}"


# -- MTP -----------------------------------------------------------------------------------------


def test_the_targets_mtp_layers_are_refused_in_one_line_naming_convert(tmp_path):
    from mlx_dspark.testing.mtp_tiny import write_tiny_qwen3_5_mtp_target

    target = write_tiny_qwen3_5_mtp_target(tmp_path / "mtp", seed=0)
    command = [sys.executable, "-m", "mlx_dspark.export", "--to", "gguf", "mtp", str(tmp_path / "d.gguf"), "--target", str(target)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "nothing to export" in run.stderr and "python -m mlx_dspark.convert TARGET" in run.stderr
    with pytest.raises(ValueError, match=r"a target, not a draft; the target's own MTP layers .* nothing to export"):
        export_draft(target, tmp_path / "ds", to="deepspec")
    with pytest.raises(ValueError, match=r"pass 'drafts/x' alone"):
        export_draft("drafts/x,mtp", tmp_path / "ds", to="deepspec")
    assert not (tmp_path / "d.gguf").exists() and not (tmp_path / "ds").exists()


def test_a_gemma4_assistant_drafter_is_refused_in_one_line(tmp_path):
    from mlx_dspark.testing.gemma4_assistant_tiny import write_assistant
    from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target

    gemma = write_tiny_mlx_lm_target(tmp_path / "gemma4", family="gemma4_text", seed=0)
    draft = write_assistant(tmp_path / "assistant", target_path=gemma, seed=1)
    with pytest.raises(ValueError, match=r"a Gemma 4 assistant drafter: export has no format for it"):
        export_draft(draft, tmp_path / "ds", to="deepspec")
