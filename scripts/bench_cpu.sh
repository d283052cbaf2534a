#!/usr/bin/env bash
# Reproduce benchmarks/RESULTS.md on a Linux CPU: writes the scaled pairs, then runs the engine
# measurement, the dataset table, the baseline parity checks and the short bf16 / 4-bit rows.
# Needs `apt-get install -y libopenblas0-pthread` (float32 rows use OpenBLAS, one thread).
# Usage: scripts/bench_cpu.sh [WORK_DIR]   (default /tmp/bench; results in WORK_DIR/r-*)
set -euo pipefail
W=${1:-/tmp/bench}
cd "$(dirname "$0")/.."
[ -f "$W/scaled/draft/config.json" ] || python scripts/make_scaled_spark_pair.py "$W/scaled"
[ -f "$W/scaled-qwen3/draft/config.json" ] || python scripts/make_scaled_spark_pair.py "$W/scaled-qwen3" --family qwen3
B="python -m mlx_dspark.benchmark --openblas --no-progress"
S="--model $W/scaled/target --draft $W/scaled/draft"
Q="--model $W/scaled-qwen3/target --draft $W/scaled-qwen3/draft"
cat /proc/loadavg
$B $S --skip-datasets --cost-curve --controlled-acceptance 3.0,4.0,4.55,6.0 --controlled-tokens 96 --repeats 3 --out "$W/r-engine-f32"
$B $S --prompts-per-dataset 1 --max-tokens 48 --ignore-eos --repeats 3 --out "$W/r-datasets-f32"
$B $S --datasets gsm8k --prompts-per-dataset 1 --max-tokens 48 --ignore-eos --parity-repeats 6 --out "$W/r-parity-spark"
$B $Q --datasets gsm8k --prompts-per-dataset 1 --max-tokens 48 --ignore-eos --parity-repeats 6 --out "$W/r-parity-qwen3"
$B $Q --datasets gsm8k,humaneval,arena-hard-v2 --prompts-per-dataset 1 --max-tokens 48 --ignore-eos --repeats 3 --out "$W/r-qwen3-f32"
SHORT="--datasets gsm8k,humaneval --prompts-per-dataset 1 --max-tokens 16 --ignore-eos --repeats 1 --cost-curve --cost-repeats 3
       --controlled-acceptance 4.55 --controlled-context 256 --controlled-prompts 1 --controlled-tokens 32"
$B $S --dtype bfloat16 $SHORT --out "$W/r-bf16"
$B $S --quantize 4 $SHORT --out "$W/r-q4"
cat /proc/loadavg
