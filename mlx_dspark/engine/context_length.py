"""Context-length rules: the context a generation must fit in, and `max_tokens` fitted to it (OpenAI's
rules), checked before any model work."""

from __future__ import annotations

from typing import Any

from mlx_dspark.engine.options import GenerationOptions


class ContextLengthError(ValueError):
    """The prompt, or the prompt plus max_tokens, does not fit in the context: checked before any model work.

    `field` is "prompt" (the prompt alone leaves no room) or "max_tokens" (lower it to `room`).
    """

    def __init__(self, message: str, *, field: str, prompt_tokens: int, max_tokens: int, context: int) -> None:
        super().__init__(message)
        self.field = field
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context = context
        self.room = max(0, context - prompt_tokens)


def context_length(model: Any, options: GenerationOptions) -> tuple[int | None, str]:
    """The context a generation must fit in, and where the number comes from (for errors)."""
    if options.max_context is not None:
        return options.max_context, "max_context / --max-context"
    config = getattr(model, "target_config", None) or {}
    context = config.get("max_position_embeddings")
    return (context, "the target's max_position_embeddings") if isinstance(context, int) and context > 0 else (None, "")


def fit_max_tokens(
    prompt_tokens: int, options: GenerationOptions, context: int | None, source: str = "max_context / --max-context"
) -> int:
    """max_tokens for this prompt: as given when it fits, the room left when `clamp_max_tokens`, else an error.

    OpenAI's rules: a max_tokens the caller chose that does not fit is refused, naming the numbers; a
    default one is shortened to the room left; a prompt that leaves no room at all is always refused.
    """
    max_tokens = options.max_tokens
    if context is None:
        return max_tokens
    room = context - prompt_tokens
    numbers = dict(prompt_tokens=prompt_tokens, max_tokens=max_tokens, context=context)
    if room < 1:
        raise ContextLengthError(
            f"the prompt is {prompt_tokens} tokens, and the context is {context} tokens ({source}): "
            "it must leave room for at least one generated token; shorten the prompt",
            field="prompt", **numbers,
        )  # fmt: skip
    if max_tokens <= room:
        return max_tokens
    if options.clamp_max_tokens:
        return room
    raise ContextLengthError(
        f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {prompt_tokens + max_tokens} tokens, "
        f"over the context of {context} tokens ({source}): lower max_tokens to at most {room} or shorten the prompt",
        field="max_tokens", **numbers,
    )  # fmt: skip
