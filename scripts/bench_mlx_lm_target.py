"""Issue 25: what running a target through mlx-lm's own model class (models/target/mlx_lm.py) costs,
beside mlx-lm's bare `__call__` and our own qwen3 module, on one scaled random qwen3 checkpoint.

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_mlx_lm_target.py [--repeats 30] [--scale tiny]

Variants, all float32 on the same weights, each with its own KV cache prefilled to `--context`
positions and trimmed back after every timed forward (so every call sees the same context):
- `mlx_lm`: mlx-lm's qwen3 `Model.__call__` (logits only): the floor;
- `adapter`: the same class behind our contract, logits + 2 tapped layers (what a round asks);
- `adapter_no_taps`: the same, no taps (the recording hooks alone);
- `ours`: our `models/qwen3.Model`, logits + the same 2 taps.
Widths 1 (a decode step) and 8 (a verify block of 7 drafts); variants interleaved within each repeat,
medians reported, with the ratio to `mlx_lm`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_dspark  # noqa: E402
from mlx_dspark.models.target.mlx_lm import from_config, probe_target  # noqa: E402
from mlx_dspark.testing.tiny import save_hf_weights, tiny_target_config, tiny_target_weights, write_tokenizer  # noqa: E402

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32)  # fmt: skip
SCALED = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, head_dim=64)  # fmt: skip
VOCAB = 32000  # the tiny 384-entry tokenizer is written beside it; only ids are used here
TAPS = (0, 2)  # valid for both scales (4 and 8 layers)


def write_scaled_qwen3(path: Path, sizes: dict) -> Path:
    path.mkdir(parents=True)
    ids = write_tokenizer(path, family="qwen3")
    config = tiny_target_config(family="qwen3", vocab_size=VOCAB, ids=ids, tie_word_embeddings=False, dtype="float32", **sizes)
    (path / "config.json").write_text(json.dumps(config))
    save_hf_weights(path, tiny_target_weights(config, seed=0))
    return path


def build(path: Path):
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    own, _ = mlx_lm.load(str(path))
    config = json.loads((path / "config.json").read_text())
    adapter = from_config(config)
    adapter.update(own.parameters())
    adapter.eval()
    probe_target(adapter)
    ours = mlx_dspark.load(str(path)).target
    return {
        "mlx_lm": lambda ids, cache: own(ids, cache=cache),
        "adapter": lambda ids, cache: adapter(ids, cache=cache, tap_ids=TAPS),
        "adapter_no_taps": lambda ids, cache: adapter(ids, cache=cache)[0],
        "ours": lambda ids, cache: ours(ids, cache=cache, tap_ids=TAPS),
    }, {"mlx_lm": lambda: make_prompt_cache(own), "adapter": adapter.make_cache, "adapter_no_taps": adapter.make_cache, "ours": ours.make_cache}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--scale", choices=("scaled", "tiny"), default="scaled",
                        help="scaled: hidden 1024, 8 layers, vocab 32000; tiny: hidden 128, 4 layers (Python overhead dominates)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_scaled_qwen3(Path(tmp) / "qwen3", SCALED if args.scale == "scaled" else TINY)
        forwards, make_caches = build(path)
    prompt = mx.array([[(7 + 13 * i) % VOCAB for i in range(args.context)]])
    caches = {}
    for name, forward in forwards.items():
        caches[name] = make_caches[name]()
        mx.eval(forward(prompt, caches[name]))
    times: dict[tuple[str, int], list[float]] = {(n, w): [] for n in forwards for w in (1, 8)}
    for repeat in range(args.repeats + 2):  # two warm-up rounds, not recorded
        for width in (1, 8):
            ids = mx.array([[(11 + 5 * i) % VOCAB for i in range(width)]])
            names = list(forwards)
            names = names[repeat % len(names):] + names[: repeat % len(names)]  # rotated: no variant always first
            for name in names:
                forward = forwards[name]
                start = time.perf_counter()
                mx.eval(forward(ids, caches[name]))
                elapsed = time.perf_counter() - start
                for cache in caches[name]:
                    cache.trim(width)
                if repeat >= 2:
                    times[(name, width)].append(elapsed * 1e3)
    print(f"{args.scale} qwen3, context {args.context}, {args.repeats} interleaved repeats, medians (ms) and ratio to mlx-lm's own __call__")
    for width in (1, 8):
        floor = statistics.median(times[("mlx_lm", width)])
        for name in forwards:
            ms = statistics.median(times[(name, width)])
            print(f"width {width}  {name:16s} {ms:8.2f} ms  x{ms / floor:.3f}")


if __name__ == "__main__":
    main()
