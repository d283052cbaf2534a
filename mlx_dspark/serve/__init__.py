"""The OpenAI-compatible HTTP server: `protocol` (wire format), `worker` (the model's one thread),
`app` (HTTP). `python -m mlx_dspark.server` is the command line."""
