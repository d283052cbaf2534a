"""The HTTP server: `protocol` (OpenAI wire format: request parsing, response shapes), `openai_writer`
(chat / text answers and chunks, tool calls, reasoning, logprobs), `anthropic` (the Messages API),
`threads` (its server-held conversations), `responses` (OpenAI's Responses API and its conversation
store), `fields` (the tools, reasoning, penalty, logprobs and constraint fields the surfaces share),
`errors` (the error every surface raises), `worker` (the model's one thread), `cache_pool` (prompt
caches kept across requests), `guards` (body, origin and text checks), `handler` (routes and streaming) and `app` (the server object). It calls `mlx_dspark.api`,
`chat_format` and the engine's options; no tensor math and no flag parsing here (`cli/server.py` owns
the flags; `python -m mlx_dspark.server` is the command)."""
