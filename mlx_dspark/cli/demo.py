"""The trained demo pair shipped in the package: what the commands run when no `--model` is given."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# The trained demo pair shipped in the package (scripts/train_demo_pair.py; benchmarks/RESULTS.md section 7).
DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"
# Stored float16 to stay small (5 MB); loaded float32: exact for float16 weights, fast on every backend
# (MLX's float16 matmuls are very slow on Linux CPUs), and the dtype its acceptance was measured in.
DEMO_DTYPE = "float32"
# Its target learned Python source only (no chat template): a raw-text prompt, the start of a method.
DEMO_PROMPT = "class Request:\n    def __init__(self, url, data=None):\n        self.url = url\n        "


@dataclasses.dataclass(frozen=True)
class DemoPair:
    """What a command runs when no `--model` is given."""

    target: Path
    draft: Path
    dtype: str = DEMO_DTYPE
    prompt: str = DEMO_PROMPT
    note: str = (
        f"no --model given: the demo pair in {DEMO_DIR} (a 1.4M-parameter qwen3 target trained on Python's "
        "standard library and its DSpark draft; it writes Python-like text)"
    )


def demo_pair() -> DemoPair:
    """The trained demo pair shipped in mlx_dspark/demo/; FileNotFoundError naming the fix when it is absent."""
    target, draft = DEMO_DIR / "target", DEMO_DIR / "draft"
    missing = [str(d / "config.json") for d in (target, draft) if not (d / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(
            f"the demo pair is not installed ({', '.join(missing)} missing): reinstall mlx_dspark with its package "
            "data, rebuild it with `python scripts/train_demo_pair.py --out mlx_dspark/demo`, or pass --model"
        )
    return DemoPair(target=target, draft=draft)


def raw_text_prompts(target_dir: Path | str | None) -> bool:
    """Whether a target asks for raw-text prompts (`"mlx_dspark_prompt_format": "raw"` in its
    generation_config.json: the demo target, and any conversion of it, since convert copies the file)."""
    if target_dir is None:
        return False
    try:
        generation = json.loads((Path(target_dir) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(generation, dict) and generation.get("mlx_dspark_prompt_format") == "raw"
