"""Bytes one speculative round reads for the real Spark-X2.6-4B pair, from its shapes (DSPARK.md section 1),
and the ideal speedup those bytes imply where every forward is memory-bound (a Mac).

    python scripts/round_bytes.py [--context 8192] [--tau 4.55]

A forward of a few rows reads each weight once, so time ~ bytes: t_decode ~ target bytes at one token,
a verify of 8 tokens about the same, the draft block its own bytes. Ideal speedup at acceptance tau:
tau * B_target / (B_draft + B_target). The Markov head's `markov_w2` (rank x V) is read once per step
(7 sequential (1, r) @ (r, V) products); the draft's LM head is the target's, read once for 7 rows.
A reduced draft vocabulary of K ids reads K rows of both. MLX's affine quantization stores, per group
of 64 weights, a 16-bit scale and bias: 4-bit = 4.5 bits/weight, 8-bit = 8.5.
Acceptance is held at tau for every row: what precision and vocabulary cost in tau is measured
separately (benchmarks/RESULTS.md, issue 20).
"""

from __future__ import annotations

import argparse

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB, WINDOW = 2560, 10240, 36, 16, 4, 256, 131072, 512
FULL_LAYERS = LAYERS // 4  # three sliding then one full, repeated
DRAFT_LAYERS, BLOCK, MARKOV_RANK, TAPS = 5, 7, 256, 5
BITS = {"bf16": 16.0, "8-bit": 8.5, "4-bit": 4.5}


def layer_params() -> int:
    qkv = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return qkv + HIDDEN * HEADS + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * INTER  # + g_proj, out_proj, MLP


def kv_bytes(positions: int, layers: int, bits: float = 16.0) -> float:
    return layers * 2 * KV_HEADS * HEAD_DIM * positions * bits / 8


def target_bytes(precision: str, context: int, kv_bits: float = 16.0) -> float:
    weights = (LAYERS * layer_params() + VOCAB * HIDDEN) * BITS[precision] / 8  # layers + tied LM head
    caches = kv_bytes(context, FULL_LAYERS, kv_bits) + kv_bytes(min(context, WINDOW), LAYERS - FULL_LAYERS)
    return weights + caches


def draft_bytes(precision: str, head_precision: str, vocab: int) -> dict[str, float]:
    return {
        "layers+fc": (DRAFT_LAYERS * layer_params() + TAPS * HIDDEN * HIDDEN) * BITS[precision] / 8,
        "lm_head": vocab * HIDDEN * BITS[head_precision] / 8,
        # DRAFT_SOURCE_PRECISION: kept in bf16 beside a 4-bit draft, quantized with an 8-bit one
        "markov": BLOCK * vocab * MARKOV_RANK * BITS["bf16" if precision == "4-bit" else precision] / 8,
        "context": kv_bytes(WINDOW, DRAFT_LAYERS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--tau", type=float, default=4.55)
    args = parser.parse_args()
    print(f"per-layer parameters {layer_params() / 1e6:.1f}M; context {args.context}; tau {args.tau}\n")
    print("| target | draft | draft vocab | target GB / verify | draft GB / block (layers+fc, LM head, Markov) | ideal speedup |")
    print("|---|---|---|---|---|---|")
    for target in ("bf16", "4-bit"):
        t = target_bytes(target, args.context)
        for draft in ("bf16", "8-bit", "4-bit"):
            for vocab in (VOCAB, 32768, 16384):
                d = draft_bytes(draft, target, vocab)
                total = sum(d.values())
                ideal = args.tau * t / (total + t)
                parts = f"{total / 1e9:.2f} ({d['layers+fc'] / 1e9:.2f}, {d['lm_head'] / 1e9:.2f}, {d['markov'] / 1e9:.2f})"
                print(f"| {target} | {draft} | {vocab} | {t / 1e9:.2f} | {parts} | {ideal:.2f}x |")


if __name__ == "__main__":
    main()
