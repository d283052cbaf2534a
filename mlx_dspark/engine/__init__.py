"""The engine: the speculative round and everything it calls.

Owns the options object (`options`), sampling (`sample`), acceptance (`accept`), proposers
(`propose`), the round's step generators (`decode`), the prompt cache (`prompt_cache`), the verify
schedule (`schedule`) and its cost probe (`cost_probe`), and the context-length rules (`context`).
It works on built models and their caches (`models/`); it never imports `loading/`, `serve/`,
`bench/`, `train/` or `cli/`: whatever it needs from above arrives as an argument.
"""
