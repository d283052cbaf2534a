"""The command lines: flag declarations and `main()`s, each a thin shell over `mlx_dspark.api`.

`common` holds the flag plumbing the commands share (one `GenerationOptions` from the flags, error
lines, the demo pair); `generate`, `chat`, `server`, `benchmark`, `convert`, `train` are the
commands. Only the entry points (`python -m mlx_dspark.X` shells, `train/__main__`, console scripts)
import this package; nothing else may.
"""
