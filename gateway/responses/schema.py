"""The Responses API's request body (``POST /v1/responses``), validated as
``gateway.requests.schemas`` validates chat: strict types, bounded numbers, a 400 naming the field.

Stricter than chat about fields it does not know, as OpenAI's Responses endpoint is: an unknown
field is a 400 (``unknown_parameter``), a known one we do not implement and that would change the
output is a 400 naming it (``REFUSED``), unless its value is the default. Built-in tools (web
search, file search, code interpreter, computer use, MCP, ...) run on OpenAI's side; pdmesh runs
only the client's function tools, so any other tool type is a 400 naming it.

``gateway.responses.items`` turns a valid body into the chat request the chat path serves.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.requests.output_schemas import MAX_TOOLS, FunctionDefinition, field_error
from gateway.requests.schemas import INT64_MAX

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
MAX_ITEMS = 4096  # input items of one request
ID = Annotated[str, Field(min_length=1, max_length=256)]


class ContentPart(BaseModel):
    """A text part of a message: ``input_text`` (user, system, developer), ``output_text`` or
    ``refusal`` (an assistant's, fed back)."""

    model_config = _STRICT
    type: Literal["input_text", "output_text", "refusal"]
    text: str = ""
    refusal: str = ""

    def plain(self) -> str:
        return self.refusal if self.type == "refusal" else self.text


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.plain() for p in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made (an earlier response's output, fed back)."""

    model_config = _STRICT
    type: Literal["function_call"]
    call_id: ID
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=1 << 20)

    @field_validator("arguments")
    @classmethod
    def _json(cls, v: str) -> str:
        try:
            json.loads(v or "{}")
        except json.JSONDecodeError:
            raise ValueError("arguments must be JSON text") from None
        return v


class FunctionCallOutputItem(BaseModel):
    """What the client's function returned for ``call_id``."""

    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: ID
    output: str | list[ContentPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.plain() for p in self.output)


class ReasoningText(BaseModel):
    model_config = _STRICT
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    """A reasoning item of an earlier response, fed back: its text goes to the next assistant turn's
    ``reasoning_content`` (templates that show earlier thinking render it)."""

    model_config = _STRICT
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]
ITEM_MODELS: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                           "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
ITEM_TYPES = tuple(ITEM_MODELS)
TEXT_PARTS = ("input_text", "output_text", "refusal", "reasoning_text", "summary_text")


class FunctionTool(FunctionDefinition):
    """``{"type": "function", "name", "description", "parameters", "strict"}``: the chat tool's
    function, flattened."""

    type: Literal["function"]


class FunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None
    verbosity: None = None  # low/medium/high: not implemented (REFUSED)


class ReasoningConfig(BaseModel):
    """Only the defaults: effort and summaries are not implemented (a reasoning model thinks as its
    template and sampling let it; its thinking comes back as ``reasoning`` items)."""

    model_config = _STRICT
    effort: None = None
    summary: None = None
    generate_summary: None = None


def _off(v) -> bool:
    return v is None or v is False or v == {} or v == [] or v == ""


# Fields of OpenAI's Responses API that change the output and that pdmesh does not implement: a
# 400 naming the field unless the value is the default (or empty).
REFUSED: dict[str, tuple] = {
    "background": (_off, "background responses are not implemented"),
    "conversation": (_off, "conversations are not implemented; use previous_response_id"),
    "include": (_off, "no extra output data (include) is implemented"),
    "prompt": (_off, "prompt templates are not implemented"),
    "top_logprobs": (lambda v: v in (None, 0), "logprobs are not implemented on /v1/responses"),
    "truncation": (lambda v: v in (None, "disabled"), "inputs are never truncated; a long one is a 400"),
    "context_management": (_off, "context management is not implemented"),
    "moderation": (_off, "moderation is not implemented"),
    "image": (_off, "image output is not implemented"),
    "access_programs": (_off, "access programs are not implemented"),
    "background_options": (_off, "background responses are not implemented"),
    "prompt_cache_options": (_off, "explicit prompt caching is not implemented"),
}


class ResponsesRequest(BaseModel):
    model_config = _STRICT

    model: str
    input: str | list[InputItem] = Field(max_length=MAX_ITEMS)
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=128)
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    stream: bool = False
    stream_options: dict | None = None  # include_obfuscation: padding we need not send
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    # accepted and echoed, no effect on the output
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1, le=INT64_MAX)  # bounds built-in tools: none run here
    priority: int = Field(default=0, ge=-(1 << 31), le=(1 << 31) - 1)  # pdmesh's, as on chat

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any):
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            if name in REFUSED:
                harmless, why = REFUSED[name]
                if not harmless(value):
                    raise field_error(name, f"{name} is not supported: {why}", "unsupported_parameter")
            elif name not in cls.model_fields:
                raise field_error(name, f"unknown parameter: {name!r}", "unknown_parameter")
        _check_tools(data.get("tools"), data.get("tool_choice"))
        _check_nested(data)
        if isinstance(data.get("input"), list):
            data = {**data, "input": [_item(i, item) for i, item in enumerate(data["input"])]}
        return data

    @model_validator(mode="after")
    def _checks(self):
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options is only allowed when stream is true")
        if isinstance(self.input, list) and not self.input:
            raise field_error("input", "input must not be empty")
        return self

    @property
    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None


# fields of a function tool that change how it is offered or called: not implemented
TOOL_REFUSED = {"defer_loading": _off, "async": _off, "allowed_callers": lambda v: v in (None, ["direct"])}


def _check_tools(tools: Any, choice: Any) -> None:
    """Built-in tools (and choices of them) are a 400 naming their type."""
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise field_error(f"tools[{i}].type", f"the built-in tool {kind!r} is not supported: pdmesh runs "
                                                      "only function tools (type \"function\")", "unsupported_parameter")
            for name, harmless in TOOL_REFUSED.items():
                if isinstance(tool, dict) and name in tool and not harmless(tool[name]):
                    raise field_error(f"tools[{i}].{name}", f"tools[{i}].{name} is not supported",
                                      "unsupported_parameter")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if isinstance(kind, str) and kind != "function":
            raise field_error("tool_choice", f"tool_choice of type {kind!r} is not supported: pdmesh runs only "
                                             "function tools", "unsupported_parameter")


NESTED_REFUSED = (("reasoning", "effort"), ("reasoning", "summary"), ("reasoning", "generate_summary"),
                  ("text", "verbosity"))


def _check_nested(data: dict) -> None:
    """Reasoning effort and summaries, text verbosity: not implemented (a 400 unless null)."""
    for outer, inner in NESTED_REFUSED:
        part = data.get(outer)
        if isinstance(part, dict) and part.get(inner) is not None:
            raise field_error(f"{outer}.{inner}", f"{outer}.{inner} is not supported", "unsupported_parameter")


TYPE_TAGS = {"str", "int", "float", "bool", "none"}  # a union's member in pydantic's error locations


def _check_item(i: int, item: dict) -> None:
    """A 400 naming the item and its field (not the union's every failure)."""
    model = ITEM_MODELS.get(item.get("type"))
    if model is None:
        return
    try:
        model.model_validate(item)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and (p in TYPE_TAGS or "[" in p)))
        msg = first["msg"].removeprefix("Value error, ")
        raise field_error(f"input[{i}].{where}" if where else f"input[{i}]",
                          f"invalid input[{i}]: {where + ': ' if where else ''}{msg}") from None


def _item(i: int, item: Any) -> Any:
    """An input item: a message without ``type`` is a message; item and part types we cannot take
    are a 400 naming them (not the union's every failure)."""
    if not isinstance(item, dict):
        return item
    kind = item.get("type")
    if kind is None and "role" in item:
        item = {**item, "type": "message"}
    elif isinstance(kind, str) and kind not in ITEM_TYPES:
        raise field_error(f"input[{i}].type", f"input items of type {kind!r} are not supported (only "
                                              f"{', '.join(ITEM_TYPES)})", "unsupported_parameter")
    if item.get("encrypted_content") is not None:
        raise field_error(f"input[{i}].encrypted_content", "encrypted reasoning is not supported",
                          "unsupported_parameter")
    for key in ("content", "output"):
        parts = item.get(key)
        for part in parts if isinstance(parts, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in TEXT_PARTS:
                raise field_error(f"input[{i}].{key}", f"content of type {kind!r} is not supported: only text "
                                                       "input is implemented", "unsupported_parameter")
    _check_item(i, item)
    return item
