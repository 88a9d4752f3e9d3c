"""What a chat request's output must be, and how to read it back: one ``OutputPlan`` per request.

    request (validated) + the model's tokenizer and template + the rendered prompt
        -> constraint    the engine enforces (JSON schema, json_object, a forcing tool grammar),
                         starting after the thinking block of a reasoning model
        -> tool format   parses calls out of the text (tool_choice auto, required, named)
        -> reasoning     splits the thinking into reasoning_content

The constraint travels to the worker in the request (phase B puts it on the wire); the parsers
run in the gateway over the detokenized stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import APIError
from gateway.reasoning import ReasoningFormat, ReasoningParser, reasoning_format
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.toolcalls import ToolCallParser
from gateway.tools import FunctionSpec, ToolFormat, forcing_constraint, tool_format
from mesh.engine.constraints.spec import Constraint
from mesh.tokenizer import Tokenizer


@dataclass(frozen=True)
class OutputPlan:
    constraint: Constraint | None = None
    tools: ToolFormat | None = None  # parse tool calls out of the text
    reasoning: ReasoningFormat | None = None
    starts_thinking: bool = False  # the prompt left a thinking block open

    def tool_parser(self) -> ToolCallParser | None:
        return self.tools.parser() if self.tools is not None else None

    def reasoning_parser(self) -> ReasoningParser | None:
        return ReasoningParser(self.reasoning, self.starts_thinking) if self.reasoning is not None else None


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
    return OutputPlan(constraint, fmt if mode != "none" else None, reasoning,
                      reasoning is not None and reasoning.starts_inside(prompt))


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
