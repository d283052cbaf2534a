"""Benchmark pieces behind `python -m mlx_dspark.benchmark`.

`prompts` / `builtin_prompts` (prompt sets), `runner` (interleaved baseline / DSpark / mlx-lm runs per
prompt), `mlx_lm_baseline`, `stats` (acceptance statistics), `lossless` (greedy token identity),
`report` (tables, JSON, Markdown), `plots`, `cost` (the cost curve and `CostProbe`), `controlled`
(controlled-acceptance engine efficiency), `controlled_tree` (a proposer at controlled top-1 / top-2
accuracy, for chain vs tree rounds), `profile` (where a round's time goes) and `session` (one
benchmark invocation end to end). Nothing here holds model math.
"""
