"""Caches that roll back: trimming and the quantized KV cache (`kv`), exact rollback of the latest forward for every mlx-lm cache kind (`rollback`), a block draft's context K/V (`draft_context`)."""
