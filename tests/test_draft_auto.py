"""`--draft auto`: the registry of known pairs (data), matched on any quantization / conversion of the
target by name or by config, the lazy download (injected here: no network), and the CLI's lines."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import typer

import mlx_dspark
from mlx_dspark.cli.common import resolve_draft
from mlx_dspark.loading.draft_registry import (
    DRAFT_PATTERNS,
    KINDS,
    check_pairs,
    choose_draft,
    known_pairs,
    normalize_name,
    resolve_auto_draft,
)

QWEN3_4B = "deepseek-ai/dspark_qwen3_4b_block7"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen/Qwen3-4B", "qwen3-4b"),
        ("mlx-community/Qwen3-4B-4bit", "qwen3-4b"),
        ("mlx-community/Qwen3-4B-MLX-8bit", "qwen3-4b"),
        ("lmstudio-community/Qwen3-4B-MLX-bf16", "qwen3-4b"),
        ("unsloth/Qwen3-4B-GGUF:Qwen3-4B-UD-Q4_K_XL.gguf", "qwen3-4b"),
        ("/models/qwen3-4b-4bit-dwq/", "qwen3-4b"),
        ("mlx-community/gemma-4-12B-it-OptiQ-4bit", "gemma-4-12b-it"),
        ("Qwen/Qwen3-4B-Instruct-2507", "qwen3-4b-instruct-2507"),  # another model, not a quantization
    ],
)
def test_repo_names_normalize_to_the_model_they_are_a_copy_of(name, expected):
    assert normalize_name(name) == expected


def test_the_registry_is_data_every_entry_complete():
    pairs = known_pairs()
    assert len(pairs) >= 8
    for pair in pairs:
        assert pair["targets"] and "/" in pair["draft"] and pair["packaging"] and pair["source"]
        assert {"model_type", "hidden_size", "num_hidden_layers", "file"} <= set(pair) and pair["kind"] in KINDS
    assert {pair["kind"] for pair in pairs} >= {"DSpark", "DFlash 2", "EAGLE-3", "Gemma 4 assistant"}
    # a signature names one draft: a renamed copy must not match two rows' configs
    signatures = [tuple(pair[k] for k in ("model_type", "hidden_size", "num_hidden_layers")) for pair in pairs if pair["model_type"]]
    assert len(signatures) == len(set(signatures))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda row: row.pop("source"), "lacks source"),
        (lambda row: row.update(kind="Medusa"), "pairs[1].kind is 'Medusa'"),
        (lambda row: row.update(draft="no-owner"), "pairs[1].draft must be an owner/name repo"),
        (lambda row: row.update(file="draft.safetensors"), "pairs[1].file must be a .gguf"),
        (lambda row: row.update(targets=[]), "pairs[1].targets"),
    ],
)
def test_a_malformed_registry_row_is_one_error_naming_the_row_and_field(change, field):
    rows = [dict(pair) for pair in known_pairs()[:2]]
    change(rows[1])
    with pytest.raises(ValueError, match=re.escape(field)):
        check_pairs(rows, source="known_drafts.json")


@pytest.mark.parametrize(
    ("target", "draft", "kind", "others"),
    [
        # DFlash 2 first (z-lab's DFlash2DraftModel files, the layout test_dflash2_draft loads); the DSpark speculator named
        ("mlx-community/Qwen3.8-27B-4bit", "z-lab/Qwen3.8-27B-DFlash2", "DFlash 2", ["RedHatAI/Qwen3.8-27B-speculator.dspark (DSpark)"]),
        ("Qwen/Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2", "DFlash 2", ["RedHatAI/Qwen3.8-27B-speculator.dspark (DSpark)"]),
        # a Gemma 4 -it target: Google's assistant, the EAGLE-3 speculator named where one is published
        ("mlx-community/gemma-4-31B-it-bf16", "google/gemma-4-31B-it-assistant", "Gemma 4 assistant",
         ["RedHatAI/gemma-4-31B-it-speculator.eagle3 (EAGLE-3)"]),
        ("mlx-community/gemma-4-26B-A4B-it-4bit", "google/gemma-4-26B-A4B-it-assistant", "Gemma 4 assistant",
         ["RedHatAI/gemma-4-26B-A4B-it-speculator.eagle3 (EAGLE-3)"]),
        ("mlx-community/gemma-4-E2B-it-bf16", "google/gemma-4-E2B-it-assistant", "Gemma 4 assistant", []),
        ("lmstudio-community/gemma-4-E4B-it-MLX-8bit", "google/gemma-4-E4B-it-assistant", "Gemma 4 assistant", []),
        # the 12B's assistant is the unified variant, not built: its DSpark draft stays
        ("mlx-community/gemma-4-12B-it-8bit", "deepseek-ai/dspark_gemma4_12b_block7", "DSpark", []),
        # EAGLE-3 where it is the only published draft, named second beside a DSpark one
        ("mlx-community/Qwen3-32B-4bit", "RedHatAI/Qwen3-32B-speculator.eagle3", "EAGLE-3", []),
        ("mlx-community/Llama-3.1-8B-Instruct-4bit", "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", "EAGLE-3", []),
        ("mlx-community/Qwen3-8B-8bit", "deepseek-ai/dspark_qwen3_8b_block7", "DSpark", ["RedHatAI/Qwen3-8B-speculator.eagle3 (EAGLE-3)"]),
    ],
)
def test_auto_takes_the_first_published_draft_of_a_target_and_names_its_kind_and_the_others(target, draft, kind, others):
    downloaded = []

    def download(repo, *, allow_patterns):
        downloaded.append(repo)
        return f"/cache/{repo}"

    def fetch_config(repo):
        raise AssertionError("a target known by name needs no config download")

    reference, line = resolve_auto_draft(target, fetch_config=fetch_config, download=download)
    assert reference == f"/cache/{draft}" and downloaded == [draft]
    assert line.startswith(f"draft auto: {draft} ({kind}, ") and "\n" not in line
    assert choose_draft(target).kind == kind
    for other in others:
        assert other in line
    assert ("also published" in line) == bool(others)


def test_the_printed_line_names_the_kind_through_the_cli(tmp_path, capsys):
    target = tmp_path / "gemma-4-31B-it-4bit"  # named as mlx-community names it; no file read for a known name

    def download(repo, *, allow_patterns):
        return str(tmp_path / "assistant")

    assert resolve_draft(str(target), "auto", no_draft=False, download=download) == str(tmp_path / "assistant")
    err = capsys.readouterr().err
    assert "draft auto: google/gemma-4-31B-it-assistant (Gemma 4 assistant, Gemma4AssistantForCausalLM)" in err


@pytest.mark.parametrize(
    ("target", "draft"),
    [
        ("Qwen/Qwen3-4B", QWEN3_4B),
        ("mlx-community/Qwen3-4B-4bit", QWEN3_4B),
        ("mlx-community/Qwen3-8B-8bit", "deepseek-ai/dspark_qwen3_8b_block7"),
        ("mlx-community/gemma-4-12b-it-8bit", "deepseek-ai/dspark_gemma4_12b_block7"),
        ("mlx-community/LFM2.5-1.2B-Instruct-bf16", "LiquidAI/LFM2.5-1.2B-Instruct-DSpark"),
    ],
)
def test_any_quantization_of_a_known_target_resolves_its_draft(target, draft):
    assert choose_draft(target).draft == draft


def test_a_renamed_copy_matches_by_model_type_hidden_size_and_depth(tmp_path):
    config = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "quantization": {"bits": 4, "group_size": 64}}
    choice = choose_draft(str(tmp_path / "my-finetune"), config)
    assert choice.draft == "deepseek-ai/dspark_qwen3_8b_block7" and "by its config" in choice.reason
    assert choose_draft("my-finetune", {**config, "num_hidden_layers": 28}) is None
    # a multimodal config nests the language model's fields
    nested = {"model_type": "qwen3", "text_config": {"hidden_size": 2560, "num_hidden_layers": 36}}
    assert choose_draft("x", nested).draft == QWEN3_4B


def test_the_download_is_lazy_only_the_drafts_files_and_no_config_fetch_for_a_known_name():
    calls = []

    def download(repo, *, allow_patterns):
        calls.append((repo, allow_patterns))
        return "/cache/draft"

    def fetch_config(repo):
        raise AssertionError("a target known by name needs no config download")

    reference, line = resolve_auto_draft("mlx-community/Qwen3-4B-4bit", fetch_config=fetch_config, download=download)
    assert reference == "/cache/draft" and calls == [(QWEN3_4B, DRAFT_PATTERNS)]
    assert not any("tokenizer" in p or "*.json" == p for p in DRAFT_PATTERNS)
    assert line.startswith(f"draft auto: {QWEN3_4B} (DSpark, DeepSpec)")


def test_an_unknown_hub_target_is_matched_on_its_config_json_alone(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 40}))
    fetched = []
    reference, _ = resolve_auto_draft("someone/renamed-model", fetch_config=lambda repo: fetched.append(repo) or config, download=None)
    assert reference == "deepseek-ai/dspark_qwen3_14b_block7" and fetched == ["someone/renamed-model"]


def test_an_unknown_target_says_how_to_pass_draft_in_one_line(tiny_qwen3_target, capsys):
    reference, line = resolve_auto_draft(str(tiny_qwen3_target), fetch_config=None, download=None)
    assert reference is None
    assert "no known draft for" in line and "model_type qwen3, hidden_size 128, num_hidden_layers 4" in line
    assert "pass --draft" in line and "--no-draft" in line and "\n" not in line
    with pytest.raises(typer.Exit) as e:
        resolve_draft(str(tiny_qwen3_target), "auto", no_draft=False, fetch_config=None, download=None)
    assert e.value.exit_code == 2
    assert capsys.readouterr().err.startswith("error: --draft auto: no known draft for")
    # the server without --draft: plain decoding, said once
    assert resolve_draft(str(tiny_qwen3_target), None, no_draft=False, serve=True, fetch_config=None, download=None) is None
    assert "serving without a draft" in capsys.readouterr().err


def test_auto_resolves_and_loads_a_known_target_and_no_draft_keeps_plain(tiny_qwen3_pair, tmp_path, capsys):
    target, draft = tiny_qwen3_pair
    quantized_copy = Path(shutil.copytree(target, tmp_path / "Qwen3-4B-4bit"))  # named as mlx-community names it
    fetched = []

    def download(repo, *, allow_patterns):
        fetched.append(repo)
        return str(draft)

    chosen = resolve_draft(str(quantized_copy), "auto", no_draft=False, download=download)
    assert chosen == str(draft) and fetched == [QWEN3_4B]
    assert f"draft auto: {QWEN3_4B}" in capsys.readouterr().err
    pair = mlx_dspark.load(quantized_copy, draft=chosen)
    plain = mlx_dspark.generate(pair, "1 2 3 4 5", max_tokens=20, speculative=False)
    assert mlx_dspark.generate(pair, "1 2 3 4 5", max_tokens=20).tokens == plain.tokens
    # the server resolves it without --draft too; --no-draft keeps plain and downloads nothing
    assert resolve_draft(str(quantized_copy), None, no_draft=False, serve=True, download=download) == str(draft)
    assert resolve_draft(str(quantized_copy), None, no_draft=True, serve=True, download=download) is None
    assert resolve_draft(str(quantized_copy), "auto", no_draft=True, download=download) is None
    assert fetched == [QWEN3_4B, QWEN3_4B]


def test_generate_with_draft_auto_for_an_unknown_target_is_one_error_line(tiny_qwen3_target):
    from typer.testing import CliRunner

    from mlx_dspark.cli.generate import app

    # a local directory: matched on its name and config.json, no network
    result = CliRunner().invoke(app, ["--model", str(tiny_qwen3_target), "--draft", "auto", "--prompt", "hi"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --draft auto: no known draft for")


def test_a_gguf_draft_entry_resolves_to_its_one_file_without_a_snapshot():
    def download(repo, *, allow_patterns):
        raise AssertionError("a GGUF draft is one file: load() fetches only it")

    reference, line = resolve_auto_draft("mlx-community/Spark-X2.6-4B-4bit", download=download)
    assert reference == "SparkLLM/Spark-X2.6-4B-DSpark-GGUF:Spark-X2.6-4B-DSpark-BF16.gguf"
    assert "model card's BF16 GGUF" in line


def test_the_server_serves_plainly_when_the_known_draft_cannot_be_downloaded(tiny_qwen3_target, tmp_path, capsys):
    copy = Path(shutil.copytree(tiny_qwen3_target, tmp_path / "Qwen3-8B-MLX-4bit"))

    def offline(repo, *, allow_patterns):
        raise FileNotFoundError(f"draft auto: {repo!r} could not be downloaded from the Hugging Face Hub (offline)")

    assert resolve_draft(str(copy), None, no_draft=False, serve=True, download=offline) is None
    assert "serving without a draft: draft auto: 'deepseek-ai/dspark_qwen3_8b_block7' could not be downloaded" in capsys.readouterr().err
    with pytest.raises(typer.Exit):  # asked for explicitly: one error line
        resolve_draft(str(copy), "auto", no_draft=False, download=offline)
    assert capsys.readouterr().err.startswith("error: draft auto: 'deepseek-ai/dspark_qwen3_8b_block7' could not be downloaded")
