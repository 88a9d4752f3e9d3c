"""What a chat request's output must be, and how to read it back: one ``OutputPlan`` per request.

    request (validated) + the model's tokenizer and template + the rendered prompt
        -> constraint    the engine enforces (JSON schema, json_object, a forcing tool grammar),
                         starting after the thinking block of a reasoning model
        -> tool format   parses calls out of the text (tool_choice auto, required, named)
        -> reasoning     splits the thinking into reasoning_content

The constraint travels to the worker in the request (``SamplingOptions.constraint``); the parsers
run in the gateway over each choice's detokenized stream (``ChoiceOutput``): the text goes through
the reasoning parser, then what is not reasoning through the tool-call parser.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import APIError
from gateway.outputs.reasoning import ReasoningFormat, ReasoningParser, reasoning_format
from gateway.outputs.toolcalls import ToolCallParser
from gateway.outputs.tools import FunctionSpec, ToolFormat, forcing_constraint, tool_format
from gateway.requests.schemas import ChatCompletionRequest, CompletionRequest
from mesh.constraints.spec import Constraint
from mesh.tokenizer import Tokenizer


@dataclass(frozen=True)
class OutputPlan:
    constraint: Constraint | None = None
    tools: ToolFormat | None = None  # parse tool calls out of the text
    reasoning: ReasoningFormat | None = None
    starts_thinking: bool = False  # the prompt left a thinking block open
    # special tokens the parsers read (their markers), kept when the text is detokenized
    keep_special: frozenset[int] = frozenset()

    def tool_parser(self) -> ToolCallParser | None:
        return self.tools.parser() if self.tools is not None else None

    def reasoning_parser(self) -> ReasoningParser | None:
        return ReasoningParser(self.reasoning, self.starts_thinking) if self.reasoning is not None else None

    def choice_output(self) -> ChoiceOutput | None:
        """A fresh reader of one choice's text (None: nothing to parse, the text is the content)."""
        if self.tools is None and self.reasoning is None:
            return None
        return ChoiceOutput(self.reasoning_parser(), self.tool_parser())


class ChoiceOutput:
    """One choice's text as it streams: reasoning, content and tool-call deltas, and the finish
    reason ``tool_calls`` once the model called a tool and stopped.

    ``parse`` rewrites a ``ChoiceDelta`` in place (``text`` becomes the content; ``reasoning`` and
    ``tool_calls`` are set); a delta with a finish reason flushes what the parsers hold back.
    """

    __slots__ = ("called", "reasoning", "tools")

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None):
        self.reasoning = reasoning
        self.tools = tools
        self.called = False

    def parse(self, d) -> None:
        final = d.finish_reason is not None
        text = d.text
        if self.reasoning is not None:
            r = self.reasoning.feed(text)
            if final:
                tail = self.reasoning.finish()
                r.reasoning += tail.reasoning
                r.content += tail.content
            d.reasoning, text = r.reasoning, r.content
        if self.tools is not None:
            m = self.tools.feed(text)
            if final:
                tail = self.tools.finish()
                m.content += tail.content
                m.tool_calls += tail.tool_calls
            text = m.content
            if m.tool_calls:
                d.tool_calls = m.tool_calls
                self.called = True
        d.text = text
        if d.finish_reason == "stop" and self.called:
            d.finish_reason = "tool_calls"


def plan_chat(body: ChatCompletionRequest, tok: Tokenizer, prompt: str, tool_override: str | None = None,
              reasoning_override: str | None = None) -> OutputPlan:
    """The plan of a chat request whose prompt rendered to ``prompt`` (raises ``APIError`` 400)."""
    try:
        reasoning = reasoning_format(tok.chat_template, reasoning_override)
        fmt = tool_format(tok.chat_template, tool_override)
    except ValueError as e:  # an operator's override names nothing we know
        raise APIError(500, str(e)) from None
    mode = body.tool_choice_mode
    if mode != "none" and fmt is None:
        raise APIError(400, "this model's tool-call format is unknown (its chat template shows none of "
                            "hermes, llama3_json, mistral); the operator can name it", "tools")
    thinks = reasoning is not None and not prompt.rstrip().endswith(reasoning.end)
    start_after = _start_after(reasoning, tok) if thinks and (body.wants_json or body.forced_tools) else None
    constraint = None
    if body.forced_tools:
        functions = [FunctionSpec(f.name, f.parameters, f.description, f.strict) for f in body.forced_tools]
        constraint = forcing_constraint(fmt, functions, body.parallel, tok.special_token_id, start_after)
    elif body.wants_json:
        constraint = _json_constraint(body, start_after)
    tools = fmt if mode != "none" else None
    return OutputPlan(constraint, tools, reasoning, reasoning is not None and reasoning.starts_inside(prompt),
                      _markers(tok, tools, reasoning))


def _markers(tok: Tokenizer, tools: ToolFormat | None, reasoning: ReasoningFormat | None) -> frozenset[int]:
    """The parsers' markers that are special tokens of this tokenizer (detokenizing would drop them)."""
    texts: list[str] = []
    if tools is not None:
        texts += [*tools.syntax.markers, tools.syntax.end]
    if reasoning is not None:
        texts += [reasoning.start, reasoning.end]
    return frozenset(i for t in texts if t and (i := tok.special_token_id(t)) is not None)


def plan_completion(body: CompletionRequest) -> OutputPlan:
    """Completions: no template, so no tools and no thinking block; JSON output only."""
    return OutputPlan(_json_constraint(body, None) if body.wants_json else None)


def _json_constraint(body, start_after: int | None) -> Constraint:
    rf = body.response_format
    if rf.type == "json_object":
        return Constraint.json_object(start_after)
    return Constraint.json_schema(rf.json_schema.schema_, start_after)


def _start_after(reasoning: ReasoningFormat, tok: Tokenizer) -> int:
    tid = reasoning.end_token_id(tok.token_to_id)
    if tid is None:
        raise APIError(400, f"this model's end-of-thinking tag {reasoning.end!r} is not one token, so a "
                            "constraint cannot wait for the thinking to end", "response_format")
    return tid
