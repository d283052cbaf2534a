"""Tiny random checkpoints in the exact Hugging Face / DeepSpec layouts, for tests, fixtures and the demo.

Never imported by the engine (models, caches, decoding, loading): only by tests, scripts and the
demo pair of the command-line entry points.
"""
