#!/usr/bin/env bash
# Engine measurements of the scaled Spark pair on an NVIDIA GPU with MLX's CUDA backend
# (the closest thing to Metal we can measure): float32, bfloat16 and 4-bit, each with the cost
# curve, the controlled-acceptance efficiency and a short dataset run against both baselines.
#
# No package index is reachable on the device machine, so the wheels travel with the tree:
# mlx_cuda_13 is split in two parts to fit the transfer limit: a first call carries .devwhl1/ and
# copies its part to /tmp/devwhl (kept while the machine stays warm), the second carries .devwhl2/
# (the other part, mlx and mlx_lm) and runs this script. Results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/bench-gpu-out}
mkdir -p "$OUT"
WHEEL=/tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
cat /tmp/devwhl/mlxcuda.part.* .devwhl2/mlxcuda.part.* > "$WHEEL" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$WHEEL" .devwhl2/mlx-*.whl .devwhl2/mlx_lm-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())" || exit 1
nvidia-smi -L
python3 scripts/make_scaled_spark_pair.py /tmp/scaled || exit 1

run() {  # name, extra flags
    local name=$1; shift
    echo "=== $name"
    python3 -m mlx_dspark.benchmark --model /tmp/scaled/target --draft /tmp/scaled/draft \
        --datasets gsm8k,humaneval,arena-hard-v2 --prompts-per-dataset 1 --max-tokens 64 --ignore-eos --repeats 3 \
        --cost-curve --controlled-acceptance 3.0,4.0,4.55,6.0 --controlled-tokens 128 --controlled-prompts 2 \
        --no-progress --out "/tmp/res-$name" "$@" ${BENCH_FLAGS:-}
    cp "/tmp/res-$name/results.json" "$OUT/$name.json"
    cp "/tmp/res-$name/results.md" "$OUT/$name.md"
}
# Arguments pick the settings (default all three); BENCH_FLAGS adds flags to every run.
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(bf16 q4 f32)
for name in "${names[@]}"; do
    case $name in
        bf16) run bf16 --dtype bfloat16 ;;
        q4) run q4 --quantize 4 ;;
        f32) run f32 ;;
        *) echo "unknown setting $name (bf16, q4, f32)"; exit 2 ;;
    esac
done
