"""JSON-schema generation with the draft masked, unmasked, and plain decoding (issue 18's benchmark).

    python scripts/bench_constrained.py [--model T --draft D] [--repeats 3] [--max-tokens 128]

Without --model it runs the trained demo pair. The variants run interleaved (plain, masked, unmasked,
and unconstrained speculative for reference), `--repeats` times each; medians are reported. Per
variant: decode tok/s (after the first token), mean acceptance length, and the host time the grammar
took per round (masks, validation), from the request's GrammarState counters.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from mlx_dspark.api import encode_prompt
from mlx_dspark.engine.logits.constraints import Constraint
from mlx_dspark.engine.options import GenerationOptions, SpeculationOptions
from mlx_dspark.engine.round.request import compile_request, make_steps
from mlx_dspark.loading.load import load

SCHEMA = {
    "type": "object",
    "properties": {
        "function": {"type": "string", "maxLength": 24},
        "arguments": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "returns": {"enum": ["int", "str", "list", "dict", "None"]},
        "doc": {"type": "string", "maxLength": 60},
    },
    "required": ["function", "arguments", "returns", "doc"],
    "additionalProperties": False,
}
PROMPT = "def parse(self, data):\n    \"\"\"Return the request as JSON: "
# The demo target learned Python: code inside a JSON string is what it (and its draft) can predict
CODE_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "code": {"type": "string"}},
    "required": ["name", "code"],
    "additionalProperties": False,
}
CODE_PROMPT = "class Request:\n    def __init__(self, url, data=None):\n        self.url = url\n        "
SCHEMAS = {"record": (SCHEMA, PROMPT), "code": (CODE_SCHEMA, CODE_PROMPT)}


def run_once(model, prompt_ids, options) -> dict:
    grammar = compile_request(model, options)
    eos = set(model.tokenizer.eos_token_ids)
    start = time.perf_counter()
    first = None
    tokens, rounds, accepted_plus_one = [], 0, 0
    for step in make_steps(model, prompt_ids, options, None, None, None, grammar):
        if first is None:
            first = time.perf_counter()
        tokens.extend(step.tokens)
        if step.verified:
            rounds += 1
            accepted_plus_one += step.accepted + 1
        if len(tokens) >= options.max_tokens or eos & set(step.tokens):
            break
    end = time.perf_counter()
    text = model.tokenizer.decode([t for t in tokens if t not in eos])
    return {
        "tokens": len(tokens),
        "tok_s": (len(tokens) - 1) / max(end - first, 1e-9),
        "acceptance": accepted_plus_one / rounds if rounds else 0.0,
        "grammar_ms_per_round": 1e3 * grammar.host_seconds / max(rounds or len(tokens), 1) if grammar else 0.0,
        "valid_json": _valid(text) if grammar else None,
        "ttft_s": first - start,
    }


def _valid(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--draft")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--schema", choices=sorted(SCHEMAS), default="record")
    args = parser.parse_args()
    if args.model is None:
        from mlx_dspark.cli.common import DEMO_DTYPE, demo_pair

        demo = demo_pair()
        model = load(str(demo.target), draft=str(demo.draft), dtype=DEMO_DTYPE)
    else:
        model = load(args.model, draft=args.draft)
    schema, prompt = SCHEMAS[args.schema]
    prompt_ids = encode_prompt(model.tokenizer, prompt)
    constraint = Constraint.json_schema(schema)
    base = GenerationOptions(max_tokens=args.max_tokens, constraint=constraint)
    variants = {
        "plain (constrained)": dataclasses.replace(base, speculation=SpeculationOptions(speculative=False)),
        "speculative, draft masked": base,
        "speculative, draft unmasked": dataclasses.replace(base, speculation=SpeculationOptions(mask_draft=False)),
        "speculative, no constraint": dataclasses.replace(base, constraint=None),
        "plain, no constraint": dataclasses.replace(base, constraint=None, speculation=SpeculationOptions(speculative=False)),
    }
    run_once(model, prompt_ids, base)  # warm-up (compiles kernels, builds the llguidance tokenizer)
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, options in variants.items():  # interleaved: the machine is shared
            results[name].append(run_once(model, prompt_ids, options))
    print(f"{'variant':30} {'tokens':>6} {'tok/s':>8} {'accept':>7} {'grammar ms/round':>17} {'valid JSON':>10}")
    for name, runs in results.items():
        median = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        valid = runs[0]["valid_json"]
        print(
            f"{name:30} {median('tokens'):6.0f} {median('tok_s'):8.1f} {median('acceptance'):7.2f} "
            f"{median('grammar_ms_per_round'):17.2f} {'-' if valid is None else str(all(r['valid_json'] for r in runs)):>10}"
        )


if __name__ == "__main__":
    main()
