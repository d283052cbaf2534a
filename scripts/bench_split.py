"""What splitting a target over ranks costs per forward, and what a real link would add (issue 36).

Run once as one process and once under `mlx.launch -n 2` (loopback here), on the same target:

    python scripts/bench_split.py --target DIR --out one.json
    mlx.launch -n 2 --backend ring --python .venv/bin/python scripts/bench_split.py --target DIR --out two.json [--pipeline]
    python scripts/bench_split.py --project one.json two.json

Pipeline parallel needs a family mlx-lm pipelines (qwen3_5, deepseek_v3, glm4_moe, ministral3): the tiny
qwen3_5 of `mlx_dspark.testing.mlx_lm_checkpoints` or larger. With `--draft DIR` the verify forwards tap the draft's
layers (a pipeline stage then adds the taps' all_sum) and a greedy generation (auto draft lengths) reports
target forwards per token: a split forward costs its collectives however many positions it verifies.

Measures, on rank 0: the verify-width cost curve of the (split) target (ms per forward of 1..8 positions
after a 256-token context, through the same lead / follow path as generation), the latency of one small
all_sum over the group, and the bytes all-reduced per forward (tensor parallel: two all_sums of
(width, hidden) per layer, from mlx-lm's shard; pipeline: the hidden state sent between stages and
all-gathered). `--project` models a Thunderbolt 5 pair from the measured one-process curve: per forward
it adds (collectives x link latency) + (bytes / link bandwidth), and the compute halves where the ranks
split it (tensor parallel: every layer; a projection, not a measurement: no second Mac here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

WIDTHS = range(1, 9)
CONTEXT = 256
# assumed link figures for the projection (Thunderbolt 5 with JACCL / RDMA): stated, not measured here
TB5_LATENCY_MS = 0.03
TB5_BYTES_PER_MS = 8e6  # 8 GB/s usable of 80 Gb/s


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def collective_ms(group) -> float:
    """The median time of one small all_sum over the group (the link's round trip, no payload)."""
    small, times = mx.ones((4,)), []
    for _ in range(50):
        start = time.perf_counter()
        mx.eval(mx.distributed.all_sum(small, group=group))
        times.append((time.perf_counter() - start) * 1e3)
    return round(median(times), 4)


def _hidden(args) -> int:
    """The hidden width (a multimodal config such as qwen3_5 keeps it in text_config)."""
    return getattr(args, "hidden_size", None) or args.text_config["hidden_size"]


def forwards_per_token(pair, tokens: int) -> dict:
    """A greedy generation of `tokens` tokens (auto draft lengths) on rank 0: target forwards per token."""
    from mlx_dspark.api import generate

    result = generate(pair, [(11 + 7 * i) % 97 for i in range(32)], max_tokens=tokens, temperature=0.0)
    return {"tokens": len(result.tokens), "target_forwards": result.target_forwards,
            "forwards_per_token": round(result.target_forwards / max(len(result.tokens), 1), 3),
            "generation_tps": round(result.generation_tps, 2)}  # fmt: skip


def measure(target_dir: str, pipeline: bool, repeats: int, *, draft_dir: str | None = None, tokens: int = 64) -> dict:
    from mlx_dspark.engine.costs.probe import undo_timed_forward
    from mlx_dspark.loading.load import load

    pair = load(target_dir, draft_dir)
    target = pair.target
    tap_ids = tuple(pair.draft.args.target_layer_ids) if draft_dir else ()
    group = mx.distributed.init() if "MLX_RANK" in os.environ else None
    ranks = 1 if group is None else group.size()
    mode, latency = "one process", None
    if ranks > 1:
        from mlx_dspark.models.distributed.split_target import PIPELINE, follow, lead, split_target

        mode = split_target(target, group, mode=PIPELINE if pipeline else None)
        latency = collective_ms(group)  # every rank, before rank 0 leads
        if group.rank() != 0:
            follow(target, group)
            return {}
        lead(target, group)
    vocab, hidden, layers = target.args.vocab_size, _hidden(target.args), target.args.num_hidden_layers
    context = mx.array([[(7 + 13 * i) % vocab for i in range(CONTEXT)]], dtype=mx.int32)
    cache = target.make_cache(max_rollback=16)
    mx.eval(target(context, cache=cache, tap_ids=tap_ids)[0])
    curve = {}
    for width in WIDTHS:
        block = mx.array([[(3 + 5 * i) % vocab for i in range(width)]], dtype=mx.int32)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            mx.eval(target(block, cache=cache, tap_ids=tap_ids)[0])
            times.append((time.perf_counter() - start) * 1e3)
            undo_timed_forward(cache, width)  # a hybrid's width-1 step stays: the context moves on by one
        curve[width] = round(median(times), 3)
    item = mx.zeros((1,), dtype=target.embedding.weight.dtype).itemsize
    per_width = (2 * layers * hidden * item) if mode == "tensor" else (2 * hidden * item)  # bytes per position
    # collectives per forward inside the layers (TP: two all_sums a layer; PP: a hop between stages, the
    # all_gather of the final state, the taps' all_sum), plus the announcement's two small all_sums
    inside = 0 if ranks == 1 else 2 * layers if mode == "tensor" else (ranks - 1) + 1 + (1 if tap_ids else 0)
    collectives = inside + (2 if ranks > 1 else 0)
    generation = forwards_per_token(pair, tokens) if draft_dir else None
    if ranks > 1:
        target.release_followers()
    return {"target": target_dir, "ranks": ranks, "mode": mode, "hidden": hidden, "layers": layers,
            "taps": list(tap_ids), "verify_ms": curve, "collective_ms": latency, "collectives_per_forward": collectives,
            "reduced_bytes_per_position": per_width, "generation": generation}  # fmt: skip


def project(one: dict, two: dict) -> dict:
    """A Thunderbolt 5 pair, from the one-process curve: half the compute (tensor parallel) plus the link."""
    rows = {}
    for width, ms in one["verify_ms"].items():
        w = int(width)
        link = two["collectives_per_forward"] * TB5_LATENCY_MS + two["reduced_bytes_per_position"] * w / TB5_BYTES_PER_MS
        compute = ms / 2 if two["mode"] == "tensor" else ms
        rows[w] = {"one_ms": ms, "loopback_two_ranks_ms": two["verify_ms"][width], "tb5_projected_ms": round(compute + link, 3),
                   "link_ms": round(link, 4)}  # fmt: skip
    return {"assumed": {"latency_ms": TB5_LATENCY_MS, "bytes_per_ms": TB5_BYTES_PER_MS}, "mode": two["mode"],
            "loopback_collective_ms": two["collective_ms"], "widths": rows}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--out")
    parser.add_argument("--draft", help="a draft for the target: taps in the verify forwards, and forwards per token")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the greedy generation (with --draft)")
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--project", nargs=2, metavar=("ONE.json", "TWO.json"))
    args = parser.parse_args()
    if args.project:
        one, two = (json.loads(Path(p).read_text()) for p in args.project)
        print(json.dumps(project(one, two), indent=1))
        return
    result = measure(args.target, args.pipeline, args.repeats, draft_dir=args.draft, tokens=args.tokens)
    if result:
        text = json.dumps(result, indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
