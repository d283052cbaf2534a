"""Issue 20, KV bits: cache memory at long contexts for the real 4B pair's shapes, and what quantized
caches change in the output.

    python scripts/bench_kv_bits.py memory --contexts 8192 32768
    python scripts/bench_kv_bits.py identity [--files 16]

`memory`: the target's caches of the Spark-X2.6-4B shapes (36 layers, 27 sliding with window 512 and
9 full, 4 KV heads of 256, bfloat16 keys/values) are built with `make_target_cache` and filled with
random keys/values up to each context, in 512-position chunks as a prefill does; reported: their
bytes and MLX's peak memory while filling. The weights are not instantiated (a 4B model does not
prefill 32k tokens on this CPU): their bytes are computed (scripts/round_bytes.py).
`identity`: the demo pair, greedy, on held-out prefixes: how often float / 8-bit / 4-bit caches
give the same output as float caches, the first differing position, and the acceptance length.
Speculative output with quantized caches always equals plain decoding with the same caches (tested).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dspark.models.caches.kv import make_target_cache  # noqa: E402

LAYER_TYPES = (["sliding_attention"] * 3 + ["full_attention"]) * 9
KV_HEADS, HEAD_DIM, WINDOW = 4, 256, 512
WEIGHTS_GB = {"bf16": 8.21, "4-bit": 2.31}  # target weights (round_bytes.py: layers + tied head)


def memory(contexts: list[int]) -> dict:
    rows = {}
    for context in contexts:
        for bits in (None, 8, 4):
            mx.clear_cache()
            mx.reset_peak_memory()
            # one random chunk reused: the bytes are what is measured, not the values
            chunk = mx.random.normal((1, KV_HEADS, 512, HEAD_DIM)).astype(mx.bfloat16)
            mx.eval(chunk)
            caches = make_target_cache(LAYER_TYPES, window=WINDOW, kv_bits=bits, kv_group_size=64)
            for start in range(0, context, 512):
                n = min(512, context - start)
                for cache in caches:
                    out = cache.update_and_fetch(chunk[:, :, :n], chunk[:, :, :n])
                    mx.eval(out)
            nbytes = sum(c.nbytes for c in caches)
            name = f"context {context}, kv {'bf16' if bits is None else f'{bits}-bit'}"
            rows[name] = {"cache_gb": round(nbytes / 1e9, 3), "peak_gb": round(mx.get_peak_memory() / 1e9, 3)}
            print(f"{name:28s} caches {nbytes / 1e9:.3f} GB, peak while filling {mx.get_peak_memory() / 1e9:.3f} GB", flush=True)
            del caches
    return rows


def identity(files: int) -> dict:
    import mlx_dspark
    from train_demo_pair import corpus_files, read

    demo = Path(__file__).resolve().parents[1] / "mlx_dspark" / "demo"
    _, held_out = corpus_files()
    pairs = {bits: mlx_dspark.load(demo / "target", demo / "draft", dtype="float32", kv_bits=bits) for bits in (None, 8, 4)}
    prompts = [pairs[None].tokenizer.encode(read(p), add_special_tokens=False)[:128] for p in held_out[:files]]
    reference = [mlx_dspark.generate(pairs[None], ids, max_tokens=128).tokens for ids in prompts]
    rows = {}
    for bits, pair in pairs.items():
        same, firsts, lengths = 0, [], []
        for ids, ref in zip(prompts, reference):
            result = mlx_dspark.generate(pair, ids, max_tokens=128)
            lengths += result.acceptance_lengths
            first = next((i for i, (a, b) in enumerate(zip(result.tokens, ref)) if a != b), None)
            same += first is None
            if first is not None:
                firsts.append(first)
        name = "float" if bits is None else f"{bits}-bit"
        rows[name] = {"identical_outputs": f"{same}/{len(prompts)}", "first_differences": firsts,
                      "mean_acceptance_length": round(sum(lengths) / len(lengths), 3)}
        print(name, rows[name], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    i = sub.add_parser("identity")
    i.add_argument("--files", type=int, default=16)
    parser.add_argument("--out")
    args = parser.parse_args()
    report = memory(args.contexts) if args.what == "memory" else identity(args.files)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
