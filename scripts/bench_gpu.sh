#!/usr/bin/env bash
# One command, under 8 minutes, JSON out: the scaled Spark pair on an NVIDIA GPU with MLX's CUDA backend
# (the closest thing to Metal we can measure). Every step runs under `timeout`, inside one overall
# budget (BUDGET_S, default 450 s after the install), and records its exit status in $OUT/summary.json,
# so a crash or a hang names its step instead of eating the machine's time.
#
#   1. bf16 probe (scripts/gpu_bf16_probe.py): op by op, then prefill / decode / a round, one process
#      each; stops at the first failure, which is the minimal reproduction of section 5's crash/hang.
#   2. engine runs (cost curve + controlled acceptance 4.55, no datasets): bf16 target + bf16 draft;
#      4-bit target with a bf16 / 8-bit / 4-bit draft; 4-bit target + 4-bit draft + reduced vocabulary.
#
# No package index is reachable on the device machine, so the wheels travel with the tree:
# mlx_cuda_13 is split in two parts to fit the transfer limit: a first call carries .devwhl1/ and
# copies its part to /tmp/devwhl (kept while the machine stays warm), the second carries .devwhl2/
# (the other part, mlx and mlx_lm) and runs this script. Results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/bench-gpu-out}
BUDGET_S=${BUDGET_S:-450}
mkdir -p "$OUT"
WHEEL=/tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
if [ -z "${SKIP_INSTALL:-}" ]; then
    cat /tmp/devwhl/mlxcuda.part.* .devwhl2/mlxcuda.part.* > "$WHEEL" || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        "$WHEEL" .devwhl2/mlx-*.whl .devwhl2/mlx_lm-*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())" || exit 1
nvidia-smi -L 2>/dev/null
PAIR=${PAIR:-/tmp/scaled}  # another pair directory (target/, draft/) for a dry run
[ -d $PAIR/draft ] || python3 scripts/make_scaled_spark_pair.py $PAIR || exit 1
# a ranking for the reduced vocabulary (random weights: its cost is what is measured, not its acceptance)
python3 -m mlx_dspark.rank_vocab --model $PAIR/target --data README.md benchmarks/RESULTS.md --out $PAIR/draft/vocab_rank.json || exit 1

START=$SECONDS
STATUS=()
step() {  # name, cap seconds, command...: runs under min(cap, budget left); records name=status
    local name=$1 cap=$2; shift 2
    local left=$((BUDGET_S - (SECONDS - START)))
    if [ $left -le 5 ]; then STATUS+=("\"$name\": \"skipped (budget)\""); return 1; fi
    [ $cap -gt $left ] && cap=$left
    echo "=== $name (timeout ${cap}s)"
    timeout --kill-after=5 $cap "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -3 "$OUT/$name.log"
    case $rc in 0) STATUS+=("\"$name\": \"ok\"");; 124|137) STATUS+=("\"$name\": \"timeout after ${cap}s\"");;
        *) STATUS+=("\"$name\": \"exit $rc\"");; esac
    return $rc
}

for s in ops prefill-400 prefill-576 decode-sync decode-async round; do
    step "bf16-probe-$s" 40 python3 scripts/gpu_bf16_probe.py $s --pair $PAIR --dtype bfloat16 || break
done

bench() {  # name, flags...
    local name=$1; shift
    step "$name" 70 python3 -m mlx_dspark.benchmark --model $PAIR/target --draft $PAIR/draft --skip-datasets \
        --cost-curve --cost-repeats 5 --controlled-acceptance 4.55 --controlled-tokens 64 --controlled-prompts 1 \
        --max-tokens 64 --no-progress --force --out "/tmp/res-$name" "$@" ${BENCH_FLAGS:-}
    [ -f "/tmp/res-$name/results.json" ] && cp "/tmp/res-$name/results.json" "$OUT/$name.json"
}
bench bf16 --dtype bfloat16
bench q4-draft-bf16 --quantize 4 --draft-quantize 0 --draft-dtype bfloat16
bench q4-draft-q8 --quantize 4 --draft-quantize 8
bench q4-draft-q4 --quantize 4 --draft-quantize 4
bench q4-draft-q4-vocab8k --quantize 4 --draft-quantize 4 --draft-vocab 8192

( IFS=,; echo "{\"device\": \"$(nvidia-smi -L 2>/dev/null | head -1)\", \"seconds\": $((SECONDS - START)), \"steps\": {${STATUS[*]}}}" ) > "$OUT/summary.json"
cat "$OUT/summary.json"
