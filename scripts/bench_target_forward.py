"""A target's forward time alone (no draft, no round): widths 1 and 8 at one context, with taps, fastest and
median of N, in this checkout. Run it from two checkouts alternately to compare target code paths.

    python scripts/bench_target_forward.py --model /tmp/bench/scaled/target --openblas
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=544)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--taps", default="2,10,18,25,33", help="tap ids the forward returns (the scaled draft's)")
    parser.add_argument("--openblas", action="store_true")
    args = parser.parse_args()
    if args.openblas and "openblas" not in os.environ.get("LD_PRELOAD", ""):
        os.execvpe(sys.executable, [sys.executable, *sys.argv],
                   {**os.environ, "LD_PRELOAD": "libopenblas.so.0", "OPENBLAS_NUM_THREADS": "1"})  # fmt: skip

    import mlx.core as mx

    import mlx_dspark
    from mlx_dspark.models.caches.kv import trim_caches

    target = mlx_dspark.load(args.model).target
    taps = tuple(int(t) for t in args.taps.split(",") if t)
    vocab = target.args.vocab_size
    cache = target.make_cache()
    out, _ = target(mx.array([[(7 + 31 * i) % vocab for i in range(args.context)]]), cache=cache)
    mx.eval(out)
    times: dict[int, list[float]] = {1: [], 8: []}
    for _ in range(args.repeats):
        for width in times:
            start = time.perf_counter()
            logits, features = target(mx.array([[5] * width]), cache=cache, tap_ids=taps)
            mx.eval(logits, features)
            times[width].append(1000 * (time.perf_counter() - start))
            # back to the context; a width-1 step stays (a wrapped rotating window cannot undo it: +1 position a repeat)
            trim_caches(cache, width if width > 1 else 0)
    print(" ".join(f"width {w}: min {min(v):.1f} median {statistics.median(v):.1f} ms" for w, v in times.items()))


if __name__ == "__main__":
    main()
