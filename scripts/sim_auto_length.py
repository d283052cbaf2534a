"""The `auto` draft-length policy on a simulated machine: a model, not a measurement.

    python scripts/sim_auto_length.py

Drives `engine/draft_length.AutoLength` with synthetic rounds: a plain step costs 0.97 x verify(1) of the
curve (plain decoding is pipelined), a round of l drafts costs the draft block + verify(1 + l), the first
round after a park also pays its draft context's catch-up, and each draft position is accepted with
probability q (independently: geometric acceptance lengths). Prints, per curve and q, the speed over
plain decoding of 256-token generations: a fresh cost cache (no acceptance memory), generations that
follow one another on one cost cache (acceptance_memory.py), and fixed length 7 — medians (and the
minimum) over seeded runs, with the probes per generation. Two curves: the demo pair on this 2-core CPU
(its draft block dearer than a target step) and a Mac-like pair (a draft block ~15% of a target step).
What it is for: comparing policies without a machine's noise; what a real machine gives is measured by
scripts/bench_never_slower.py.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import tempfile
from pathlib import Path

from mlx_dspark.engine.policy import draft_length
from mlx_dspark.engine.policy.draft_length import AutoLength
from mlx_dspark.engine.costs.curve import CostCurve

SEGMENT = 64  # tokens per stretch of a changing text
CURVES = {
    "demo pair, 2-core CPU": (CostCurve(draft_ms=6.4, verify_ms=[4.5, 5.7, 6.7, 7.4, 8.5, 9.0, 10.1, 10.9]), 9.0),
    "Mac-like pair": (CostCurve(draft_ms=3.0, verify_ms=[20.0, 20.5, 21.0, 21.6, 22.2, 23.0, 24.0, 25.0]), 1.0),
}


def generation(curve: CostCurve, catch_up_ms: float, q: float | tuple[float, ...], *, seed: int, memory: Path | None = None,
               fixed: int | None = None, tokens: int = 256) -> tuple[float, int]:
    """(speed over plain decoding, probes) of one simulated generation; `q` a tuple: the acceptance of
    successive 64-token stretches of the text (a text whose predictability changes), cycled."""
    clock = [0.0]
    draft_length.time.perf_counter = lambda: clock[0] / 1000.0  # the policy times its rounds on this clock
    policy = AutoLength(curve if memory is None else dataclasses.replace(curve, cache_path=memory, checked=3), 7, heal=True)
    rng = random.Random(seed)
    plain = 0.97 * curve.verify_ms[0]
    made, after_park = 0, True
    while made < tokens:
        length = fixed or policy.next_length(position=0)
        if length == 0:
            clock[0] += plain
            made += 1
            policy.observe(proposed=0, accepted=0)
            after_park = True
            continue
        if after_park:
            clock[0] += catch_up_ms
            policy.untimed(catch_up_ms)
        clock[0] += curve.draft_ms + curve.verify_ms[length]
        accepted = 0
        rate = q if isinstance(q, float) else q[(made // SEGMENT) % len(q)]
        while accepted < length and rng.random() < rate:
            accepted += 1
        made += accepted + 1
        if not fixed:
            policy.observe(proposed=length, accepted=accepted)
        after_park = False
    if memory is not None:
        policy.finish()
    return tokens * plain / clock[0], 0 if fixed else policy.probes


def main() -> None:
    for name, (curve, catch_up) in CURVES.items():
        print(f"{name}: draft block {curve.draft_ms} ms, verify(1..8) {list(curve.verify_ms)} ms, catch-up {catch_up} ms")
        for q in (0.0, 0.2, 0.5, 0.7, 0.85, 0.95, (0.95, 0.05), (0.95, 0.5)):
            tokens = 256 if isinstance(q, float) else 512
            fresh = [generation(curve, catch_up, q, seed=s, tokens=tokens) for s in range(20)]
            remembered = []
            for series in range(5):  # four generations on one cost cache; the first one's is `fresh`
                path = Path(tempfile.mkdtemp()) / "curve.json"
                path.write_text(json.dumps(curve.to_json()))
                remembered += [generation(curve, catch_up, q, seed=100 * series + g, memory=path, tokens=tokens) for g in range(4)][1:]
            fixed = [generation(curve, catch_up, q, seed=s, fixed=7, tokens=tokens)[0] for s in range(20)]
            name = f"{q:.2f}" if isinstance(q, float) else "/".join(f"{x:.2f}" for x in q) + f" by {SEGMENT} tokens"
            print(f"  q={name}: fresh x{statistics.median(r for r, _ in fresh):.3f} ({statistics.mean(p for _, p in fresh):.1f} probes)"
                  f" | after a generation x{statistics.median(r for r, _ in remembered):.3f} (min {min(r for r, _ in remembered):.3f},"
                  f" {statistics.mean(p for _, p in remembered):.1f} probes) | fixed 7 x{statistics.median(fixed):.3f}")


if __name__ == "__main__":
    main()
