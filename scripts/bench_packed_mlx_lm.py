"""Packed forward vs one forward per sequence, for a target run through mlx-lm's own class.

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_packed_mlx_lm.py [--family qwen3_5]

A random float32 llama, or qwen3_5 hybrid (its recurrent layers run once per sequence inside the packed
forward), behind models/target/mlx_lm.py (sizes below), and W sequences
(W = 1, 2, 4, 8) at a context of --context tokens each verify a block of --block rows:
- solo: W forwards, one per sequence (what a queue of single requests runs);
- packed: one `packed_target_forward` over the W x block rows (models/packed/mlx_lm.py).
Both with the draft's taps, every cache rolled back after the forward (so each repeat sees the same
context). Variants interleaved per repeat, medians over repeats; the ratio solo / packed is printed with
the cost curve (a single sequence's forward of n rows) beside it, and the largest |packed - solo| logit.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx.utils import tree_map  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from mlx_dspark.models.caches.kv import trim_caches  # noqa: E402
from mlx_dspark.models.target.mlx_lm import probe_target, target_class  # noqa: E402
from mlx_dspark.models.packed.forward import packed_target_forward  # noqa: E402
from mlx_dspark.models.packed.mlx_lm import target_packing_problem as packing_problem  # noqa: E402


def build(family: str, hidden: int, layers: int, vocab: int):
    if family == "qwen3_5":  # the hybrid: 3 GatedDeltaNet layers per attention layer (testing's scaled one)
        from mlx_dspark.testing.mlx_lm_models import scaled_qwen3_5

        model = scaled_qwen3_5(hidden=hidden, layers=layers, vocab=vocab)
        target = target_class(type(model))(model.args)
        target.update(model.parameters())
        mx.eval(target.parameters())
        probe_target(target)
        return target
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=int(hidden * 2.75),
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), rms_norm_eps=1e-5,
        vocab_size=vocab, head_dim=64, tie_word_embeddings=False, rope_theta=10000.0,
    )  # fmt: skip
    mx.random.seed(0)
    target = target_class(llama.Model)(args)
    target.update(tree_map(lambda w: mx.random.normal(w.shape) / w.shape[-1] ** 0.5 if w.ndim == 2 else w, target.parameters()))
    mx.eval(target.parameters())
    probe_target(target)
    return target


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def main(
    family: str = typer.Option("llama", "--family", help="llama, or qwen3_5 (a GatedDeltaNet hybrid)"),
    hidden: int = typer.Option(1024, "--hidden"),
    layers: int = typer.Option(8, "--layers"),
    vocab: int = typer.Option(32000, "--vocab"),
    context: int = typer.Option(256, "--context"),
    block: int = typer.Option(4, "--block", help="rows each sequence verifies"),
    widths: str = typer.Option("1,2,4,8", "--widths"),
    repeats: int = typer.Option(5, "--repeats"),
) -> None:
    target = build(family, hidden, layers, vocab)
    problem = packing_problem(target)  # the load-time check (and, for a hybrid, how its recurrent layers run)
    assert problem is None, problem
    taps = (1, layers // 2)
    counts = [int(w) for w in widths.split(",")]
    caches = []
    for i in range(max(counts)):
        cache = target.make_cache()
        mx.eval(target(mx.array([(7 * i + 13 * j) % vocab for j in range(context)])[None], cache=cache)[0])
        caches.append(cache)
    segments = [mx.array([(3 + 11 * i + j) % vocab for j in range(block)], dtype=mx.int32) for i in range(max(counts))]

    def solo(w):
        out = []
        for cache, seg in zip(caches[:w], segments[:w]):
            logits, features = target(seg[None], cache=cache, tap_ids=taps)
            mx.eval(logits, features)
            out.append(logits[0])
            trim_caches(cache, block)
        return out

    def packed(w):
        logits, features = packed_target_forward(target, mx.concatenate(segments[:w]), caches[:w], [block] * w, tap_ids=taps)
        mx.eval(logits, features)
        for cache in caches[:w]:
            trim_caches(cache, block)
        return logits

    def rows(n):  # one sequence, n rows: the cost curve
        logits, _ = target(mx.arange(n, dtype=mx.int32)[None] % vocab, cache=caches[0], tap_ids=taps)
        mx.eval(logits)
        trim_caches(caches[0], n)

    for w in counts:  # warm-up and the exactness check
        diff = mx.max(mx.abs(packed(w) - mx.concatenate(solo(w)))).item()
        print(f"width {w}: max |packed - solo| logit {diff:.3g}")
    curve_rows = sorted({block * w for w in counts})  # >= 2 rows: a hybrid rolls back only recorded forwards
    times: dict[str, list[float]] = {}
    for r in range(repeats):
        for w in counts[r % len(counts):] + counts[: r % len(counts)]:  # rotated order
            times.setdefault(f"solo {w}", []).append(timed(lambda: solo(w)))
            times.setdefault(f"packed {w}", []).append(timed(lambda: packed(w)))
        for n in curve_rows:
            times.setdefault(f"rows {n}", []).append(timed(lambda: rows(n)))
    med = {k: statistics.median(v) for k, v in times.items()}
    if family == "qwen3_5":
        print(f"recurrent layers per sequence: {target._dspark_split_mode}")
    print(f"{family} hidden {hidden}, {layers} layers, vocab {vocab}, float32; context {context}, block {block}, {repeats} repeats (medians)")
    print("cost curve (one sequence, n rows): " + ", ".join(f"{n}: {med[f'rows {n}']:.1f} ms" for n in curve_rows))
    for w in counts:
        s, p = med[f"solo {w}"], med[f"packed {w}"]
        print(f"W={w}: solo {s:.1f} ms, packed {p:.1f} ms, solo/packed {s / p:.2f}x; packed vs one sequence of {block * w} rows {p / med[f'rows {block * w}']:.2f}x")


if __name__ == "__main__":
    typer.run(main)
