"""The model-card table from per-prompt records: one row per dataset plus the average; text, JSON, Markdown.

A row's tok/s are means over its prompts of each prompt's median; its speedup is the ratio of the
means (as the card reports "31 -> 77 tok/s (2.50x)"); its acceptance length pools all DSpark rounds.
The baseline is the faster of ours and mlx-lm's, per prompt. The average row averages the rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from mlx_dspark.bench.stats import mean


def category_rows(records: Sequence[dict]) -> list[dict]:
    order: list[str] = []
    grouped: dict[str, list[dict]] = {}
    for record in records:
        if record["category"] not in grouped:
            order.append(record["category"])
        grouped.setdefault(record["category"], []).append(record)
    rows = []
    for name in order:
        group = grouped[name]
        lengths = [r["dspark"]["mean_acceptance_length"] * r["dspark"]["rounds"] for r in group]
        rounds = sum(r["dspark"]["rounds"] for r in group)
        without = mean([r["best_baseline_tps"] for r in group])
        with_dspark = mean([r["dspark"]["generation_tps"] for r in group])
        ours = mean([r["baseline"]["generation_tps"] for r in group])
        mlx_lm = [r["mlx_lm"]["generation_tps"] for r in group if r["mlx_lm"]]
        lossless = [r["lossless"]["identical"] for r in group if r["lossless"] is not None]
        rows.append(
            {
                "dataset": name,
                "prompts": len(group),
                "tps_without": without,
                "tps_with": with_dspark,
                "speedup": with_dspark / without if without > 0 else 0.0,
                "mean_acceptance_length": round(sum(lengths) / rounds, 3) if rounds else 0.0,
                "our_baseline_tps": ours,
                "mlx_lm_baseline_tps": mean(mlx_lm) if mlx_lm else None,
                "greedy_identical": (sum(lossless) / len(lossless)) if lossless else None,
            }
        )
    return rows


def average_row(rows: Sequence[dict]) -> dict:
    def avg(key: str):
        values = [r[key] for r in rows if r[key] is not None]
        return mean(values) if values else None

    without, with_dspark = avg("tps_without"), avg("tps_with")
    return {
        "dataset": "Average",
        "prompts": sum(r["prompts"] for r in rows),
        "tps_without": without,
        "tps_with": with_dspark,
        "speedup": with_dspark / without if without else 0.0,
        "mean_acceptance_length": round(avg("mean_acceptance_length"), 3),
        "our_baseline_tps": avg("our_baseline_tps"),
        "mlx_lm_baseline_tps": avg("mlx_lm_baseline_tps"),
        "greedy_identical": avg("greedy_identical"),
    }


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table_lines(rows: Sequence[dict], *, markdown: bool) -> list[str]:
    header = ["Dataset", "tok/s without -> with", "Speedup", "Mean acc. length", "ours / mlx-lm baseline tok/s", "greedy identical"]
    body = []
    for r in rows:
        body.append(
            [
                r["dataset"],
                f"{r['tps_without']:.1f} -> {r['tps_with']:.1f}",
                f"{r['speedup']:.2f}x",
                _fmt(r["mean_acceptance_length"], ".2f"),
                f"{r['our_baseline_tps']:.1f} / {_fmt(r['mlx_lm_baseline_tps'], '.1f')}",
                _fmt(None if r["greedy_identical"] is None else 100 * r["greedy_identical"], ".0f") + ("%" if r["greedy_identical"] is not None else ""),
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return lines
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return [fmt(header), "  ".join("-" * w for w in widths), *[fmt(cells) for cells in body]]


def lossless_lines(records: Sequence[dict]) -> list[str]:
    checked = [r for r in records if r["lossless"] is not None]
    if not checked:
        return ["Losslessness: not checked (sampling runs)."]
    same = sum(r["lossless"]["identical"] for r in checked)
    lines = [f"Greedy speculative output token-identical to the baseline: {same}/{len(checked)} prompts."]
    for r in checked:
        info = r["lossless"]
        if not info["identical"]:
            margin = _fmt(info["top2_margin"], ".3g")
            lines.append(f"  {r['category']} #{r['index']}: first difference at token {info['first_difference']}, target top-2 logit margin there {margin}")
    return lines


def build_results(records: Sequence[dict], *, meta: dict) -> dict:
    rows = category_rows(records)
    return {"meta": meta, "rows": rows, "average": average_row(rows) if rows else None, "prompts": list(records)}


def write_outputs(results: dict, out_dir: Path, *, extra_sections: Sequence[str] = ()) -> list[Path]:
    """results.json and results.md (the table, losslessness, then any extra text sections)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    md = ["# mlx_dspark benchmark", ""]
    meta = results["meta"]
    md += [f"- {key}: {value}" for key, value in meta.items()]
    if results["rows"]:
        md += ["", *table_lines([*results["rows"], results["average"]], markdown=True), ""]
        md += lossless_lines(results["prompts"])
    for section in extra_sections:
        md += ["", "```", section, "```"]
    md_path = out_dir / "results.md"
    md_path.write_text("\n".join(md) + "\n", encoding="utf-8")
    return [json_path, md_path]
