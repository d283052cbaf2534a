"""Training DSpark drafts in MLX, following DeepSpec's objective.

`python -m mlx_dspark.train --target T --data FILES --out DIR` trains a new draft (or fine-tunes one
with `--init-draft`); `python -m mlx_dspark.train.calibrate` fits the confidence head's per-position
temperatures. Modules: `data` (files to token chunks and batches), `forward` (the draft's training
forward over sampled anchors), `losses` (DeepSpec's objective), `drafts` (new / existing drafts, saving),
`loop` (optimizer, checkpoints, resume), `calibration` (the confidence temperatures), `session` (one run
end to end). The flags live in `cli/train.py`; `__main__` and `calibrate` are the thin entry points.
Nothing here imports `serve/` or `cli/`.
"""
