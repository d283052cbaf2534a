"""A request admitted on the handler's thread before any byte of the answer: the model is ready, the
prompt renders (template, tools, reasoning switch) and fits the context. Its errors are plain 400s, so
a stream never starts for a request that cannot run, and the headers can carry the request's warnings;
the worker then reads the prepared prompt (`GenerationRequest.prepare` is done once).

Context errors are written as agents read them: Anthropic's "prompt is too long: N tokens > M maximum"
and "input length and `max_tokens` exceed context limit: P + T > C" (Claude Code compacts or lowers
max_tokens on these), OpenAI's `context_length_exceeded` with its own wording.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlx_dspark.chat_format.prompt import is_template_error
from mlx_dspark.chat_format.tools import ToolChoice

from mlx_dspark.engine.context_length import ContextLengthError, context_length, fit_max_tokens
from mlx_dspark.serve.errors import APIError
from mlx_dspark.serve.protocol import GenerationRequest
from mlx_dspark.serve.worker import READY

_PROMPT_FIELDS = {"chat": "messages", "anthropic": "messages", "responses": "input", "text": "prompt"}


def context_error(err: ContextLengthError, kind: str) -> APIError:
    """The context error in the wording clients of `kind`'s API look for."""
    p, t, c = err.prompt_tokens, err.max_tokens, err.context
    if kind == "anthropic":
        if err.field == "prompt":
            message = f"prompt is too long: {p} tokens > {c - 1} maximum"
        else:
            message = (f"input length and `max_tokens` exceed context limit: {p} + {t} > {c}, "
                       "decrease input length or `max_tokens` and try again")
        return APIError(400, message, param="max_tokens" if err.field == "max_tokens" else "messages",
                        code="context_length_exceeded")
    prompt_field = _PROMPT_FIELDS.get(kind, "prompt")
    what = "messages" if prompt_field == "messages" else prompt_field
    message = (f"This model's maximum context length is {c} tokens. However, you requested {p + (t if err.field == 'max_tokens' else 1)} "
               f"tokens ({p} in the {what}, {t if err.field == 'max_tokens' else 1} in the completion). Please reduce "
               f"the length of the {what} or completion. ({err})")
    return APIError(400, message, param="max_tokens" if err.field == "max_tokens" else prompt_field,
                    code="context_length_exceeded")


def admit(worker: Any, request: GenerationRequest) -> list[int]:
    """Prepare `request` for `worker`'s model; its prompt ids. APIErrors: 503 while the model is not
    ready, 400 for a prompt that cannot be rendered or does not fit."""
    if worker.state != READY:
        worker.submit(request)  # raises the 503 saying why
    try:
        ids, options = request.prepare(worker.model.tokenizer)
        fit_max_tokens(len(ids), options, *context_length(worker.model, options))
    except APIError:
        raise
    except ContextLengthError as err:
        raise context_error(err, request.kind) from None
    except Exception as err:  # noqa: BLE001  (the template's own errors: jinja's, ValueErrors)
        if isinstance(err, ValueError) and getattr(err, "field", None):  # a tool / reasoning field
            raise APIError(400, str(err), param=err.field, code="invalid_value") from None
        if is_template_error(err):
            raise APIError(400, str(err), code="invalid_prompt") from None
        raise
    return ids


def force_tool_call(request: GenerationRequest, name: str) -> bool:
    """`--force-tool-call NAME` (a trial aid for models too weak to call tools on their own): the first
    model turn of a conversation (no assistant turn yet, the user spoke last) that offers the tool NAME
    and leaves the choice to the model gets NAME as its named tool_choice; every later turn is the
    model's own."""
    setup = request.tools
    if setup.choice.mode != "auto" or name not in [t["function"]["name"] for t in setup.tools]:
        return False
    turns = [m for m in request.prompt if isinstance(m, dict) and m.get("role") != "system"] \
        if isinstance(request.prompt, list) else []
    if not turns or turns[-1].get("role") != "user" or any(m.get("role") == "assistant" for m in turns):
        return False
    request.tools = dataclasses.replace(setup, choice=ToolChoice("named", name))
    request.warnings.append(f"the server forced a call of {name!r} (--force-tool-call)")
    return True
