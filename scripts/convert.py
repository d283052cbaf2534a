"""Convert a Hugging Face checkpoint to MLX; same as `python -m mlx_dspark.convert` (see --help)."""

from __future__ import annotations

import sys
from pathlib import Path

# run from a checkout without installing the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dspark.convert import main  # noqa: E402

if __name__ == "__main__":
    main()
