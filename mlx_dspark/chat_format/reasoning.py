"""`reasoning_effort` (OpenAI's none / minimal / low / medium / high / xhigh) onto a chat template's own
thinking switch.

Per template family, recognised by the switch the template reads:
- Spark (`thinking_effort`, "low" / "high", unset = no thinking; DSPARK.md section 1): none and
  minimal -> unset (None), low -> "low", medium, high and xhigh -> "high".
- Qwen3 (`enable_thinking`, on / off): none and minimal -> False, every other effort -> True.
A template with neither switch cannot honour an effort: a ValueError rather than a guess.
"""

from __future__ import annotations

from typing import Any

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_SPARK = {"none": None, "minimal": None, "low": "low", "medium": "high", "high": "high", "xhigh": "high"}


class ReasoningError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"'{field}': {message}")
        self.field = field


def template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def has_thinking_switch(tokenizer: Any) -> bool:
    """The template reads Spark's `thinking_effort` or Qwen3's `enable_thinking`."""
    template = template_text(tokenizer)
    return "thinking_effort" in template or "enable_thinking" in template


def reasoning_switch(tokenizer: Any, effort: Any, *, field: str = "reasoning_effort") -> dict:
    """The chat_template_kwargs that set `effort` on this tokenizer's template."""
    if effort not in REASONING_EFFORTS:
        raise ReasoningError(field, f"must be one of {list(REASONING_EFFORTS)}, got {effort!r}")
    template = template_text(tokenizer)
    if "thinking_effort" in template:
        return {"thinking_effort": _SPARK[effort]}
    if "enable_thinking" in template:
        return {"enable_thinking": effort not in ("none", "minimal")}
    raise ReasoningError(field, "this model's chat template has no thinking switch (neither Spark's thinking_effort "
                                "nor Qwen3's enable_thinking), so an effort cannot be set")


def thinking_budget_switch(tokenizer: Any, enabled: bool, *, field: str = "thinking") -> dict:
    """Anthropic's `thinking: {"type": "enabled" | "disabled"}` on the same switches ("high" / off)."""
    return reasoning_switch(tokenizer, "high" if enabled else "none", field=field)
