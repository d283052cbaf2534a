"""Where bfloat16 fails on MLX's CUDA backend: one step per process, so a crash or hang names its step.

    python scripts/gpu_bf16_probe.py STEP [--pair DIR] [--dtype bfloat16]    # prints one JSON line

Steps, from the smallest op to the loop that failed (RESULTS.md section 5: an illegal memory access
in the pipelined plain decode right after a prefill of 512 + 64 tokens; hangs in later runs):
  ops           matmul, rms_norm, rope, sdpa (causal, boolean mask) at the pair's shapes
  prefill-400   one prefill of 400 tokens (one chunk, caches under 512)
  prefill-576   a prefill of 576 tokens in chunks of 512 + 64 (the KV buffer grows past 512)
  decode-sync   prefill-576 then 16 decode steps, each evaluated before the next is built
  decode-async  prefill-576 then 16 pipelined decode steps (mx.async_eval, as plain_steps runs them)
  round         prefill-576 then 8 speculative rounds (draft block + verify + trim)
Run each under `timeout`; the first step that fails or times out is the minimal reproduction.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

STEPS = ("ops", "prefill-400", "prefill-576", "decode-sync", "decode-async", "round")


def ops(dtype) -> None:
    x = mx.random.normal((1, 8, 512)).astype(dtype)
    w = mx.random.normal((1024, 512)).astype(dtype)
    mx.eval(x @ w.T)
    mx.eval(mx.fast.rms_norm(x, mx.ones((512,), dtype), 1e-6))
    q = mx.random.normal((1, 8, 8, 64)).astype(dtype)
    k = mx.random.normal((1, 2, 576, 64)).astype(dtype)
    mx.eval(mx.fast.rope(q, 64, traditional=False, base=10000.0, scale=1.0, offset=568))
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal"))
    mask = mx.ones((8, 576), dtype=mx.bool_)
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask=mask))


def run(step: str, pair_dir: str, dtype: str) -> None:
    if step == "ops":
        return ops(getattr(mx, dtype))
    import mlx_dspark
    from mlx_dspark.engine.round.decode import prefill, speculative_steps
    from mlx_dspark.engine.proposers.dspark import DraftProposer
    from mlx_dspark.engine.logits.sample import Sampler

    pair = mlx_dspark.load(f"{pair_dir}/target", f"{pair_dir}/draft", dtype=dtype)
    target = pair.target
    length = 400 if step == "prefill-400" else 576
    prompt = [(7 * i + 3) % target.args.vocab_size for i in range(length)]
    if step == "round":
        proposer = DraftProposer(pair.draft, target, greedy=True, temperature=1.0)
        for i, _ in enumerate(speculative_steps(target, proposer, prompt, sampler=Sampler())):
            if i == 8:
                break
        return
    cache = target.make_cache()
    logits = prefill(target, cache, prompt, step_size=512)
    mx.eval(logits)
    if step.startswith("prefill"):
        return
    token = mx.argmax(logits).reshape(1, 1)
    for _ in range(16):
        out, _ = target(token, cache=cache)
        token = mx.argmax(out[0, -1]).reshape(1, 1)
        if step == "decode-sync":
            mx.eval(token)
        else:
            mx.async_eval(token)
    mx.eval(token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=STEPS)
    parser.add_argument("--pair", default="/tmp/scaled")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    start = time.perf_counter()
    print(json.dumps({"step": args.step, "dtype": args.dtype, "device": str(mx.default_device()), "started": True}), flush=True)
    run(args.step, args.pair, args.dtype)
    print(json.dumps({"step": args.step, "dtype": args.dtype, "ok": True, "seconds": round(time.perf_counter() - start, 2)}), flush=True)


if __name__ == "__main__":
    main()
