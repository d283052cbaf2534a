"""One assistant turn's tool setup: which tools the template renders, the constraint a forced choice
needs, and the reader of the output (`api.stream_generate(tools=...)` and the server both use it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from mlx_dspark.chat_format.output import CALL, CALL_BEGIN, CALL_CUT, CALL_DELTA, REASONING, OutputParser, ParsedOutput
from mlx_dspark.chat_format.prompt import starts_in_reasoning
from mlx_dspark.chat_format.tools import ToolChoice, ToolError, check_choice, check_tools, forced_call_constraint, openai_choice


@dataclass(frozen=True)
class ToolSetup:
    """Checked tools (OpenAI chat format), the choice among them and whether several calls may follow."""

    tools: tuple[dict, ...] = ()
    choice: ToolChoice = ToolChoice()
    parallel: bool = True

    @classmethod
    def of(cls, tools: Sequence[dict] | None, tool_choice: Any = None, *, parallel: bool = True,
           field: str = "tools", choice_field: str = "tool_choice") -> ToolSetup:
        checked = check_tools(list(tools) if tools is not None else None, field=field)
        choice = tool_choice if isinstance(tool_choice, ToolChoice) else openai_choice(tool_choice, field=choice_field)
        if not isinstance(parallel, bool):
            raise ToolError("parallel_tool_calls", f"must be true or false, got {parallel!r}")
        return cls(tools=tuple(checked), choice=check_choice(choice, checked, field=choice_field), parallel=parallel)

    @property
    def offered(self) -> list[dict] | None:
        """The tools the template renders (none under tool_choice "none")."""
        return list(self.tools) if self.tools and self.choice.mode != "none" else None

    def constraint(self, tokenizer: Any, *, field: str = "tool_choice") -> Any:
        """The constraint forcing the call, or None when the model decides (a ToolError when it cannot)."""
        if not self.choice.forced:
            return None
        return forced_call_constraint(tokenizer, self.tools, self.choice, parallel=self.parallel, field=field)

    @property
    def single_call(self) -> bool:
        """One call ends the answer: a named forced call, or parallel calls turned off."""
        return self.choice.mode == "named" or not self.parallel

    def parser(self, tokenizer: Any, prompt_ids: Sequence[int]) -> OutputParser:
        return OutputParser.for_tokenizer(tokenizer, in_reasoning=starts_in_reasoning(tokenizer, prompt_ids),
                                          parse_tools=self.offered is not None, tools=self.tools,
                                          max_calls=1 if self.single_call else None)


@dataclass
class OutputCollector:
    """A parser's events joined into one ParsedOutput as a stream goes."""

    parser: OutputParser
    output: ParsedOutput = field(default_factory=ParsedOutput)
    cut: bool = False  # the output ended inside a call (left out of `output`)

    @property
    def ended(self) -> bool:
        """The single call allowed is complete: the answer is over whatever the model does next."""
        return self.parser.ended

    def add(self, text: str, *, final: bool) -> list[tuple[str, Any]]:
        events = self.parser.feed(text) if text else []
        if final:
            events += self.parser.finish()
        for kind, value in events:
            if kind == CALL:
                self.output.tool_calls.append(value)
            elif kind == CALL_CUT:
                self.cut = True
            elif kind in (CALL_BEGIN, CALL_DELTA):
                continue  # a streamed call's pieces: the closing CALL event carries it whole
            elif kind == REASONING:
                self.output.reasoning = (self.output.reasoning or "") + value
            else:
                self.output.content += value
        return events
