"""A cost curve measured under load heals within one generation (issue 33.2): the demo pair's cached
curve with a draft block ten times too slow parks `auto` for good without healing (no length can pay by
it, so it never even probes); with healing the first round that drafts times the real block, `auto`
drafts, and the corrected curve is back in the cost cache with what healed it. Real timings: the demo
pair's true draft block is a few ms on any CPU, the planted one 10x that."""

from __future__ import annotations

import dataclasses
import json

import pytest

import mlx_dspark
from mlx_dspark.cli.demo import demo_pair
from mlx_dspark.engine.costs import heal as cost_heal
from mlx_dspark.engine.costs import probe as cost_probe
from mlx_dspark.engine.costs.heal import CurveHealer
from mlx_dspark.engine.costs.probe import measure_cost_curve  # the real one (the autouse fixture patches the module's)
from mlx_dspark.engine.options import GenerationOptions, SpeculationOptions  # noqa: F401
from mlx_dspark.engine.costs.curve import CostCurve


def _ten_times_slower_draft(curve: CostCurve) -> CostCurve:
    deep = None if curve.deep is None else _ten_times_slower_draft(curve.deep)
    return dataclasses.replace(curve, draft_ms=10 * curve.draft_ms, deep=deep)


def test_a_curve_measured_under_load_heals_within_a_generation_and_the_cache_keeps_the_correction(tmp_path, monkeypatch):
    monkeypatch.setenv(cost_probe.COST_DIR_ENV, str(tmp_path))
    demo = demo_pair()
    pair = mlx_dspark.load(str(demo.target), draft=str(demo.draft))
    true = measure_cost_curve(pair.target, pair.draft)
    path = cost_probe.cost_curve_path(pair)
    cost_probe.write_cached(path, {**_ten_times_slower_draft(true).to_json(), "source": "measured under load (test)"})
    prompt = pair.tokenizer.encode("Once upon a time, there was a little girl named Lily. She liked to")
    options = GenerationOptions(max_tokens=96, speculation=SpeculationOptions(lookup="off"))

    monkeypatch.setattr(cost_heal, "ENABLED", False)
    stuck = mlx_dspark.generate(pair, prompt, options=options)
    assert set(stuck.draft_lengths) == {0}, stuck.draft_lengths  # the bad curve parks it for good

    monkeypatch.setattr(cost_heal, "ENABLED", True)
    healed = mlx_dspark.generate(pair, prompt, options=options)
    assert healed.tokens == stuck.tokens  # lossless either way
    drafted = sum(n for length, n in healed.draft_lengths.items() if length > 0)
    assert drafted >= 5 and healed.target_forwards < 0.8 * stuck.target_forwards, healed.draft_lengths
    cached = json.loads(path.read_text())
    assert cached["healing"]["healed"] and cached["draft_block_ms"] < 0.4 * 10 * true.draft_ms, cached
    assert cached["checked"] > 0 and cached["source"] == "measured under load (test)"
    again = cost_probe.cost_curve_for(pair)  # the next run starts from the correction and is not re-checked
    assert again.draft_ms == pytest.approx(cached["draft_block_ms"]) and again.checked > 0


def test_the_healer_moves_a_component_only_past_its_tolerance():
    base = CostCurve(draft_ms=10.0, verify_ms=[4.0, 5.0, 6.0], cache_path=None)
    healer = CurveHealer(base)
    for ms in (4.2, 3.9, 4.4, 4.1, 3.8, 4.3, 4.0, 4.2):  # plain steps within 25% of verify(1)
        healer.observe(proposed=0, ms=ms)
    healer.observe(proposed=2, ms=16.5)  # a round of 2 drafts: 10 ms block + 6 ms verify, near the curve
    assert healer.curve is base and healer.checked
    for ms in (12.0,) * 8:  # steps three times slower than the curve: the verify times scale
        healer.observe(proposed=0, ms=ms)
    healer.observe(proposed=2, ms=30.0)
    healed = healer.curve
    assert healed.verify_ms[0] > 4.0 * 1.25  # past the tolerance: scaled, every width alike
    assert healed.verify_ms[2] / healed.verify_ms[0] == pytest.approx(6.0 / 4.0)


def test_calibrate_says_how_old_and_how_trusted_the_curve_is(tmp_path):
    from mlx_dspark.cli.calibrate import _trust

    path = tmp_path / "curve.json"
    curve = CostCurve(draft_ms=28.0, verify_ms=[4.0, 5.0])
    cost_probe.write_cached(path, {**curve.to_json(), "source": "measured at first use, 2026-12-01 10:00", "measured_at": 0})
    fresh = _trust(path)
    assert fresh["trust"].startswith("not yet checked") and fresh["age_hours"] > 24 and fresh["checked_rounds"] == 0
    healer = CurveHealer(dataclasses.replace(CostCurve.from_file(path), cache_path=path))
    for _ in range(8):
        healer.observe(proposed=0, ms=4.0)
    healer.observe(proposed=1, ms=11.6)  # a 6.6 ms block, not 28
    told = _trust(path)
    assert "corrected by observed rounds" in told["trust"] and "28.00 -> 6.60 ms" in told["trust"], told
    assert told["checked_rounds"] == 9 and told["measured"] == "measured at first use, 2026-12-01 10:00"
