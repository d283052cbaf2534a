"""Export: our drafts written in other engines' formats, the reverse direction of `loading/`.

`write` (`export_draft`: one entry for both formats, never overwriting without `force`), `source`
(any draft we load, dequantized where it was MLX-quantized), `gguf` (upstream llama.cpp's `dflash`
DSpark GGUF) and `deepspec` (DeepSpec's Hugging Face layout, read by DeepSpec, vLLM and SGLang).
`python -m mlx_dspark.export` runs `__main__` (flags in `cli/export.py`). It reads drafts through
`loading/` and builds `models/`; it must not import `engine/`, `serve/`, `bench/`, `train/` or `cli/`.
"""
