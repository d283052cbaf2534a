"""The draft heads the scaled pair lacks, at its shape: `python scripts/make_scaled_heads.py OUT`.

Beside `scripts/make_scaled_spark_pair.py OUT` (OUT/target, OUT/draft; an EAGLE-3 draft comes from
`scripts/bench_heads.py`), so every head kind can be measured at one shape (issue 35):

- OUT/dflash2: the scaled DSpark draft's backbone as a DFlash 2 draft (z-lab layout, block size 7,
  random convolutions and candidate selector; testing/dflash2_tiny.py). Needs OUT/draft.
- OUT/mtp-target: a qwen3_5 target with one MTP layer (`--draft mtp`), the scaled pair's widths
  (hidden 512, 8 x 64 query heads, 2 KV heads, intermediate 1024, vocab 32000, 36 layers: three
  GatedDeltaNet then one full-attention, GatedDeltaNet 4 key / 8 value heads of 64), in the Hugging
  Face layout (testing/mtp_tiny.py). Its own target: a Spark target carries no MTP layers.
- OUT/gemma4-target and OUT/gemma4-assistant: a gemma4_text target at the same widths (36 layers, five
  sliding (window 512) then one full, full layers with 128-wide heads and one KV head, as Gemma 4's) and a
  Gemma 4 assistant drafter for it (two layers of width 256, every layer reading the target's K/V;
  testing/gemma4_assistant_tiny.py).

The widths (hidden, heads, KV heads, head dim, intermediate, vocabulary) are read from OUT/target's
config.json. `--only dflash2`, `--only mtp` or `--only gemma4` writes one of them. Random weights: use these for cost curves and
the controlled-acceptance benchmark only, never for acceptance numbers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

# run from a checkout without installing the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dspark.testing.dflash2_tiny import write_dflash2_draft  # noqa: E402
from mlx_dspark.testing.gemma4_assistant_tiny import write_assistant  # noqa: E402
from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target  # noqa: E402
from mlx_dspark.testing.mtp_tiny import write_tiny_qwen3_5_mtp_target  # noqa: E402

NUM_LAYERS = 36  # as the scaled Spark target
HEADS = ("dflash2", "mtp", "gemma4")
ASSISTANT_HIDDEN = 256

app = typer.Typer(add_completion=False)


def scaled_mtp_text_config(*, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, vocab: int) -> dict:
    """text_config fields of a qwen3_5 target at the scaled pair's widths (partial rotary 0.25 as Qwen3.5)."""
    rotary_pairs = head_dim // 8  # head_dim * 0.25 rotary dims, half of them pairs
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "num_hidden_layers": NUM_LAYERS,
        "full_attention_interval": 4,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "max_position_embeddings": 65536,
        "rope_parameters": {"rope_type": "default", "mrope_section": [rotary_pairs // 2, rotary_pairs // 4, rotary_pairs // 4],
                            "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},  # fmt: skip
    }


def scaled_gemma4_config(*, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, vocab: int) -> dict:
    """gemma4_text fields (over the tiny family's) at the scaled pair's widths."""
    layers = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(NUM_LAYERS)]
    return {
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "global_head_dim": 2 * head_dim, "num_global_key_value_heads": 1, "intermediate_size": intermediate,
        "vocab_size": vocab, "num_hidden_layers": NUM_LAYERS, "layer_types": layers, "max_position_embeddings": 65536,
    }  # fmt: skip


def scaled_widths(out_dir: Path) -> dict:
    """The scaled pair's widths, read from OUT/target/config.json (the heads are built at its shape)."""
    config_path = out_dir / "target" / "config.json"
    if not config_path.is_file():
        raise typer.BadParameter(f"{config_path} not found: run scripts/make_scaled_spark_pair.py {out_dir} first")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    names = {"hidden": "hidden_size", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
             "intermediate": "intermediate_size", "vocab": "vocab_size"}  # fmt: skip
    missing = [key for key in names.values() if key not in config]
    if missing:
        raise typer.BadParameter(f"{config_path} has no {', '.join(missing)}")
    return {name: int(config[key]) for name, key in names.items()}


@app.command()
def main(
    out_dir: Path = typer.Argument(..., help="the scaled pair's directory (OUT/target gives the widths, OUT/draft the DFlash 2 backbone)"),
    only: str = typer.Option(None, "--only", help="dflash2, mtp or gemma4 (default: all three)"),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    if only is not None and only not in HEADS:
        typer.echo(f"error: --only {only!r} is not one of {', '.join(HEADS)}", err=True)
        raise typer.Exit(2)
    widths = scaled_widths(out_dir)
    if only in (None, "dflash2"):
        if not (out_dir / "draft" / "config.json").is_file():
            typer.echo(f"error: {out_dir / 'draft'} holds no draft: run scripts/make_scaled_spark_pair.py {out_dir} first", err=True)
            raise typer.Exit(2)
        path = write_dflash2_draft(out_dir / "draft", out_dir / "dflash2", seed=seed + 4, kernel_size=3)
        typer.echo(f"wrote {path}")
    if only in (None, "mtp"):
        path = write_tiny_qwen3_5_mtp_target(out_dir / "mtp-target", seed=seed, **scaled_mtp_text_config(**widths))
        typer.echo(f"wrote {path}")
    if only in (None, "gemma4"):
        target = write_tiny_mlx_lm_target(out_dir / "gemma4-target", family="gemma4_text", seed=seed, **scaled_gemma4_config(**widths))
        path = write_assistant(out_dir / "gemma4-assistant", target_path=target, seed=seed + 1, hidden_size=ASSISTANT_HIDDEN)
        typer.echo(f"wrote {target} and {path}")


if __name__ == "__main__":
    app()
