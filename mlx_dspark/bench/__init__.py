"""Benchmark pieces behind `python -m mlx_dspark.benchmark`.

`prompts` (built-in and jsonl prompt sets), `runner` (interleaved baseline / DSpark / mlx-lm runs),
`stats` (acceptance statistics), `lossless` (greedy token identity), `report` (tables, JSON,
Markdown), `plots`, `cost` (the target/draft cost curve) and `controlled` (the controlled-acceptance
proposer for engine-efficiency measurements). Nothing here holds model math.
"""
