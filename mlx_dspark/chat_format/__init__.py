"""The chat format: what the chat template makes of messages and tools, and what the model's text means.

Owns rendering prompts (`prompt`: messages, token ids or text into token ids, tools through the
template's own tools support), the tools themselves (`tools`: checked function definitions, the tool
choice, the constraint that forces a call), the reasoning switch per template family (`reasoning`) and
the reading of the output (`output`: reasoning, content and tool calls, streamed or whole, with the
tokenizer's tool parser). Pure text and tokenizer work: it may use the engine's constraints, never
`loading/`, `serve/`, `bench/`, `train/`, `cli/` or `api`.
"""
