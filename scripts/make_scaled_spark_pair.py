"""Write a *scaled Spark* synthetic pair for engine measurements: `python scripts/make_scaled_spark_pair.py OUT`.

OUT/target is a spark2_5 target with the real Spark-X2.6-4B pair's structure (36 layers, three
sliding then one full, window 512, tied embeddings, partial rotary on full layers) and OUT/draft a
5-layer windowed DSpark draft tapping layers [2, 10, 18, 25, 33] with block size 7. Width and
vocabulary are scaled down (hidden 512, 8 x 64 query heads, 2 KV heads, intermediate 1024,
vocab 32000: 97M target parameters) so that one float32 decode step costs tens of milliseconds on
a small CPU, the reference set-up of ../shared/BENCHMARKING.md.

The Markov rank is scaled too (default 32): the real head's W2 (131072 x 256) is ~0.8% of the 4B
target's parameters, and 32000 x 32 is ~1% of the scaled target's, so the seven sequential Markov
products weigh about as much against a decode step as they do on the real pair.

`--family qwen3` writes the same sizes as a qwen3 pair (36 full-attention layers; the draft keeps 5
windowed layers): mlx-lm has its own qwen3 model, so on that pair our plain decoding can be compared
with mlx-lm's model as well as with its loop.

`scripts/make_scaled_heads.py OUT` adds the other head kinds at this shape (a DFlash 2 draft, a qwen3_5
target with an MTP layer, a gemma4_text target with a Gemma 4 assistant), so
`scripts/bench_heads_controlled.py` can measure every head kind at controlled acceptance.

Random weights accept almost nothing: use this pair for cost curves and the controlled-acceptance
benchmark, never for acceptance numbers. The tokenizer is the tiny byte-level one (384 entries);
ids above it decode to placeholder text, which the benchmarks do not read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

# run from a checkout without installing the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dspark.testing.tiny import (  # noqa: E402
    FAMILIES,
    save_hf_weights,
    tiny_target_config,
    tiny_target_weights,
    write_tiny_draft,
    write_tokenizer,
)

# The real 4B pair's structure (DSPARK.md section 1).
NUM_LAYERS = 36
WINDOW = 512
TAP_IDS = [2, 10, 18, 25, 33]
DRAFT_LAYERS = 5
BLOCK_SIZE = 7

app = typer.Typer(add_completion=False)


def scaled_target_config(
    ids: dict, *, family: str, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, vocab: int, dtype: str
) -> dict:
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {FAMILIES}")
    window = {"sliding_window": WINDOW} if family == "spark2_5" else {}
    return tiny_target_config(
        family=family,
        vocab_size=vocab,
        ids=ids,
        tie_word_embeddings=True,
        dtype=dtype,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        num_hidden_layers=NUM_LAYERS,
        max_position_embeddings=65536,
        **window,
    )


def write_scaled_target(
    path: Path,
    *,
    family: str = "spark2_5",
    hidden: int = 512,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int = 1024,
    vocab: int = 32000,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """A target with the 4B's layer structure and the given (scaled) width and vocabulary."""
    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path, family=family)
    config = scaled_target_config(
        ids, family=family, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate, vocab=vocab, dtype=dtype
    )
    (path / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    generation = {"bos_token_id": ids["bos"], "eos_token_id": ids["gen_eos"], "pad_token_id": ids["pad"]}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    save_hf_weights(path, tiny_target_weights(config, seed=seed), dtype=dtype)
    return path


@app.command()
def main(
    out_dir: Path = typer.Argument(..., help="directory to write OUT/target and OUT/draft into"),
    family: str = typer.Option("spark2_5", "--family", help="spark2_5 (the Spark pair) or qwen3 (same sizes)"),
    hidden: int = typer.Option(512, "--hidden"),
    heads: int = typer.Option(8, "--heads"),
    kv_heads: int = typer.Option(2, "--kv-heads"),
    head_dim: int = typer.Option(64, "--head-dim"),
    intermediate: int = typer.Option(1024, "--intermediate"),
    vocab: int = typer.Option(32000, "--vocab"),
    markov_rank: int = typer.Option(32, "--markov-rank"),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16 on disk"),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    if family not in FAMILIES:
        typer.echo(f"error: --family {family!r} is not one of {', '.join(FAMILIES)}", err=True)
        raise typer.Exit(2)
    target = write_scaled_target(
        out_dir / "target",
        family=family,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        dtype=dtype,
        seed=seed,
    )
    write_tiny_draft(
        out_dir / "draft",
        target_path=target,
        markov_head_type="vanilla",
        markov_rank=markov_rank,
        layer_types=["sliding_attention"] * DRAFT_LAYERS,
        sliding_window=WINDOW,
        target_layer_ids=TAP_IDS,
        seed=seed,
        dtype=dtype,
    )
    typer.echo(f"wrote {out_dir / 'target'} and {out_dir / 'draft'}")


if __name__ == "__main__":
    app()
