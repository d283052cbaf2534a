"""A forced tool call on the trained demo pair: speculative vs plain decoding, the draft masked or not.

The call is `write_file(path, content)` (tool_choice "required"), so the arguments are the demo
model's own code-like text inside a JSON string: what a coding agent's tool call looks like. Runs
alternate the variants (the machine may be shared) and report medians; greedy, so every variant must
write the same call (checked).

    python scripts/bench_tool_calls.py --repeats 3 --max-tokens 160
"""

from __future__ import annotations

import argparse
import statistics

from mlx_dspark.api import generate
from mlx_dspark.cli.common import demo_pair
from mlx_dspark.loading.load import load

WRITE_FILE = {"type": "function", "function": {"name": "write_file", "description": "Write a Python file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 24}, "content": {"type": "string"}},
    "required": ["path", "content"], "additionalProperties": False}}}
MESSAGES = [{"role": "system", "content": "You write Python files with write_file."},
            {"role": "user", "content": "def read_config(path):"}]
VARIANTS = {"plain": dict(speculative=False), "speculative, draft masked": dict(mask_draft=True),
            "speculative, draft unmasked": dict(mask_draft=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    demo = demo_pair()
    pair = load(demo.target, draft=demo.draft, dtype=demo.dtype)
    runs: dict[str, list] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, knobs in VARIANTS.items():
            runs[name].append(generate(pair, MESSAGES, tools=[WRITE_FILE], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=args.max_tokens, **knobs))
    texts = {r.text for rs in runs.values() for r in rs}
    assert len(texts) == 1, "greedy variants disagree"
    first = runs["plain"][0]
    print(f"call: {first.tool_calls[0].name if first.tool_calls else None}, {len(first.tokens)} tokens, "
          f"finish {first.finish_reason}")
    print("| variant | tok/s (median) | mean acceptance length | rounds |")
    print("|---|---|---|---|")
    for name, rs in runs.items():
        tps = statistics.median(r.generation_tps for r in rs)
        print(f"| {name} | {tps:.1f} | {rs[0].mean_acceptance_length:.2f} | {rs[0].rounds} |")


if __name__ == "__main__":
    main()
