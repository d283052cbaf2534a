"""Loading: from what a user names to built models.

Owns finding and reading checkpoints of every format (`checkpoint`; GGUF in `gguf_*`), weights into
built models (`weights`), dtypes and quantization (`precision`), the pair checks (`pair`), tokenizers
(`tokenizer`, `gguf_tokenizer`), `load()` itself (`load`) and conversion to MLX (`convert`,
`gguf_convert`, `mlx_output`). It builds `models/`; it must not import the engine's internals,
`serve/` or `cli/`.
"""
