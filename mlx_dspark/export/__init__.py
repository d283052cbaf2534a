"""Export: our drafts written in other engines' formats, the reverse direction of `loading/`.

`write` (`export_draft`: one entry for every format, the formats each kind of draft fits, never
overwriting without `force`), `source` (any draft we load, dequantized where it was MLX-quantized),
`gguf` (upstream llama.cpp's `dflash` DSpark / DFlash GGUF) with `gguf_dflash2` (a DFlash 2 draft's part
of it), `deepspec` (DeepSpec's Hugging Face layout, read by DeepSpec, vLLM and SGLang), `zlab` (z-lab's
DFlash 2 layout), `speculators` (vLLM speculators' EAGLE-3 layout), `hf_files` (the directory they write).
`python -m mlx_dspark.export` runs `__main__` (flags in `cli/export.py`). It reads drafts through
`loading/` and builds `models/`; it must not import `engine/`, `serve/`, `bench/`, `train/` or `cli/`.
"""
