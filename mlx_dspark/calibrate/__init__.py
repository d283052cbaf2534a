"""`python -m mlx_dspark.calibrate`: this machine's cost curve for a pair, and what `auto` draft lengths make of it.

Only the entry point (`__main__`, flags in `cli/calibrate.py`): the measurement is `engine/costs/probe.py`,
the draft-length policy `engine/policy/draft_length.py`. It must not be imported by anything.
"""
