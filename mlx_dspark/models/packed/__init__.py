"""Packed forwards for continuous batching: several sequences' rows in one forward, each over its own caches (`forward`, mlx-lm targets in `mlx_lm`, chained drafter steps in `chain`)."""
