"""Write a target and a small draft model where the draft pays on a small CPU: `python scripts/make_lm_draft_pair.py OUT`.

**A synthetic pair with controlled agreement, not a trained draft.** Random weights (fixed seed), float32, Hugging
Face layout (config.json, model.safetensors, the demo pair's tokenizer files: vocabulary 2048), so mlx-lm and
mlx_dspark both load them as they are:

- OUT/target: a qwen3 model of a scaled shape (default hidden 1024, 16 x 64 query heads, 4 KV heads,
  intermediate 3072, 12 layers, untied head: ~160M parameters, ~640 MB), big enough that with OpenBLAS one thread
  a verify of 3-8 tokens costs about what one token does (../shared/BENCHMARKING.md);
- OUT/draft: a qwen3 model of `--draft-layers` (default 1) layers of the same width whose layers ARE the target's
  first layers, with the same embedding, final norm and LM head (~16M parameters): mlx-lm's `--draft-model`.

The target's remaining layers have their output projections (`o_proj`, `down_proj`) scaled by a small epsilon, so
they only nudge the residual stream that the shared first layers write: the target's greedy choice is the draft's
most of the time. Epsilon is found by bisection (unless `--epsilon` is given) so that the draft's greedy token equals
the target's on a share `--agreement` (default 0.78) of the positions of the target's own greedy continuations of a
few prompts, measured here and written to OUT/pair.json with the epsilon. That share is the per-token acceptance of
a greedy round's drafts (roughly: a draft after a rejected one is never verified).

The default shape's bisection took 12 minutes on a loaded 2-core CPU (bundled BLAS; eight measurements) and
settled on epsilon 0.02458, agreement 0.786 (seed 0): `--epsilon 0.02458` writes the same pair in one measurement.

Random weights write text no person would: the continuations are whatever the shared first layers make of the
prompt; the benchmark ignores end-of-sequence and compares token ids.

    python scripts/make_lm_draft_pair.py /tmp/lmpair
    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_vs_mlx_lm.py \\
        --model /tmp/lmpair/target --draft /tmp/lmpair/draft --sweep 1,3,4,5,6 --max-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

# run from a checkout without installing the package
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENIZER_SOURCE = ROOT / "mlx_dspark" / "demo" / "target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
VOCAB = 2048
# prompts whose continuations the agreement is measured on (the benchmark's own prompts are others too)
CALIBRATION_PROMPTS = (
    "def parse(self, text):\n    tokens = []\n    for line in text.splitlines():\n",
    "The committee met on Tuesday to review the budget, and after a long discussion",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n",
)


def config(*, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "max_position_embeddings": 4096,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


def build(cfg: dict):
    from mlx_lm.models.qwen3 import Model, ModelArgs

    model = Model(ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    return model


def scaled_names(model, first: int) -> list[str]:
    """The output projections of the layers from `first` on (what epsilon scales)."""
    return [name for name, _ in tree_flatten(model.parameters())
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= first
            and name.endswith(("o_proj.weight", "down_proj.weight"))]  # fmt: skip


def set_epsilon(model, originals: dict[str, mx.array], epsilon: float) -> None:
    model.load_weights([(name, w * epsilon) for name, w in originals.items()], strict=False)
    mx.eval(model.parameters())


def greedy_continuation(model, ids: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    steps = generate_step(mx.array(ids, dtype=mx.int32), model, max_tokens=n, sampler=make_sampler(temp=0.0))
    return [int(token) for token, _ in steps]


def agreement(target, draft, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """The share of the target's greedy continuation positions where the draft's greedy token is the target's,
    and the share of distinct tokens in those continuations (how repetitive the text is)."""
    agree = total = 0
    distinct = []
    for ids in prompts:
        generated = greedy_continuation(target, ids, n)
        sequence = mx.array(ids + generated[:-1], dtype=mx.int32)[None]
        t = mx.argmax(target(sequence)[0, len(ids) - 1 :], axis=-1)
        d = mx.argmax(draft(sequence)[0, len(ids) - 1 :], axis=-1)
        agree += int((t == d).sum())
        total += len(generated)
        distinct.append(len(set(generated)) / len(generated))
    return agree / total, sum(distinct) / len(distinct)


def save(model, cfg: dict, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_SOURCE / name, directory / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--agreement", type=float, default=0.78, help="the greedy agreement epsilon is bisected to")
    parser.add_argument("--epsilon", type=float, default=None, help="a fixed epsilon (no bisection)")
    parser.add_argument("--calibration-tokens", type=int, default=64, help="continuation length per calibration prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 1 <= args.draft_layers < args.layers:
        sys.exit(f"error: --draft-layers must be 1 .. {args.layers - 1}")

    from mlx_dspark.loading.tokenizer import load_tokenizer

    mx.random.seed(args.seed)
    shape = dict(hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate=args.intermediate)
    target_cfg = config(layers=args.layers, **shape)
    draft_cfg = config(layers=args.draft_layers, **shape)
    target = build(target_cfg)
    draft = build(draft_cfg)
    shared = [(name, w) for name, w in tree_flatten(target.parameters())
              if not name.startswith("model.layers.") or int(name.split(".")[2]) < args.draft_layers]  # fmt: skip
    draft.load_weights(shared, strict=True)
    mx.eval(draft.parameters())
    originals = {name: w for name, w in tree_flatten(target.parameters()) if name in set(scaled_names(target, args.draft_layers))}

    tokenizer = load_tokenizer(TOKENIZER_SOURCE, json.loads((TOKENIZER_SOURCE / "config.json").read_text()))
    prompts = [list(tokenizer.encode(p)) for p in CALIBRATION_PROMPTS]
    measure = lambda eps: (set_epsilon(target, originals, eps), agreement(target, draft, prompts, args.calibration_tokens))[1]  # noqa: E731

    if args.epsilon is not None:
        epsilon = args.epsilon
        share, distinct = measure(epsilon)
        print(f"epsilon {epsilon:.4g}: agreement {share:.3f}, distinct tokens {distinct:.2f}")
    else:  # agreement falls as epsilon grows: bisect log(epsilon)
        lo, hi = math.log(1e-4), math.log(1.0)
        best = None
        for _ in range(10):
            mid = (lo + hi) / 2
            share, distinct = measure(math.exp(mid))
            print(f"epsilon {math.exp(mid):.4g}: agreement {share:.3f}, distinct tokens {distinct:.2f}")
            if best is None or abs(share - args.agreement) < abs(best[1] - args.agreement):
                best = (math.exp(mid), share, distinct)
            if abs(share - args.agreement) < 0.02:
                break
            lo, hi = (mid, hi) if share > args.agreement else (lo, mid)
        epsilon, share, distinct = best
        set_epsilon(target, originals, epsilon)

    save(target, target_cfg, args.out / "target")
    save(draft, draft_cfg, args.out / "draft")
    params = lambda m: sum(w.size for _, w in tree_flatten(m.parameters()))  # noqa: E731
    note = {"what": "synthetic pair with controlled agreement (random weights, not a trained draft)",
            "epsilon": epsilon, "measured_greedy_agreement": round(share, 4), "distinct_token_share": round(distinct, 3),
            "calibration": {"prompts": len(prompts), "tokens_each": args.calibration_tokens}, "seed": args.seed,
            "target_parameters": params(target), "draft_parameters": params(draft), "draft_layers": args.draft_layers,
            "target_layers": args.layers}  # fmt: skip
    (args.out / "pair.json").write_text(json.dumps(note, indent=1) + "\n")
    print(f"wrote {args.out}/target ({note['target_parameters'] / 1e6:.0f}M parameters) and {args.out}/draft "
          f"({note['draft_parameters'] / 1e6:.0f}M): epsilon {epsilon:.4g}, greedy agreement {share:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
