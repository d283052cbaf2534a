"""The README's first command (the demo pair, greedy, its Python prompt, 256 tokens) in one process:
plain decoding, `--max-draft-tokens auto` and the card's fixed 7, interleaved after a warm-up; medians.
Run as is (bundled BLAS) and with `LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1` (Linux)."""
import statistics

import mlx_dspark
from mlx_dspark.cli.demo import demo_pair

REPEATS = 6
d = demo_pair()
m = mlx_dspark.load(str(d.target), draft=str(d.draft), dtype=d.dtype)
runs = {"plain": [], "auto": [], "fixed7": []}
kw = {"plain": dict(speculative=False), "auto": {}, "fixed7": dict(max_draft_tokens=7)}
mlx_dspark.generate(m, d.prompt, max_tokens=64)
for i in range(REPEATS):
    for k in runs:
        r = mlx_dspark.generate(m, d.prompt, max_tokens=256, **kw[k])
        runs[k].append(r.generation_tps)
for k, v in runs.items():
    print(k, "median tok/s %.1f" % statistics.median(v), [round(x) for x in v])
