"""The HTTP server: `protocol` (OpenAI wire format: request parsing, response bodies), `worker` (the
model's one thread), `cache_pool` (prompt caches kept across requests), `guards` (body, origin and
text checks), `handler` (routes and streaming) and `app` (the server object). It calls `mlx_dspark.api`
and the engine's options; no tensor math and no flag parsing here (`cli/server.py` owns the flags;
`python -m mlx_dspark.server` is the command)."""
