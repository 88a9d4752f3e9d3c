"""Request models of structured output: response formats, tools, tool choices, tool calls in a
conversation's history, and the fields we refuse (``REFUSED``). ``gateway.requests.schemas``
builds the request bodies from them."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mesh.constraints.validate import schema_problem

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def field_error(param: str, message: str, code: str = "invalid_value") -> PydanticCustomError:
    """A validation error that names its request field (``gateway.errors`` reads ``param``)."""
    return PydanticCustomError("named_field_error", "{message}", {"message": message, "param": param, "code": code})


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
MAX_TOOLS = 128


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str = Field(max_length=256)
    arguments: str = Field(max_length=1 << 20)  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A call in an earlier assistant message (the conversation's history)."""

    model_config = _STRICT
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall

    @field_validator("function")
    @classmethod
    def _json_arguments(cls, v: FunctionCall):
        try:
            json.loads(v.arguments or "{}")
        except json.JSONDecodeError:
            raise ValueError("function.arguments must be JSON text") from None
        return v

    def template_dict(self) -> dict:
        """As chat templates read it: the arguments as an object (templates ``tojson`` them)."""
        args = json.loads(self.function.arguments or "{}")
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


def _enforceable(schema: Any, what: str) -> Any:
    problem = schema_problem(schema)
    if problem:
        raise ValueError(f"{what} cannot be enforced: {problem}")
    return schema


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)
    name: FunctionName
    description: str | None = None
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema exactly, strict or not

    @field_validator("schema_")
    @classmethod
    def _schema(cls, v):
        return _enforceable(v, "the schema")


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise field_error("response_format.json_schema", "missing required parameter: response_format.json_schema",
                              "missing_required_parameter")
        return self


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; absent: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v):
        return v if v is None else _enforceable(v, "parameters")


class ToolDefinition(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition

    def template_dict(self) -> dict:
        """The OpenAI tool object, as templates read it (``tool.function.parameters``)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ToolChoiceFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: ToolChoiceFunction


# Fields of other servers (vLLM, TGI, llama.cpp) or of OpenAI that change what the model must
# produce and that we do not implement: a 400 naming the field unless the value is the default.
# Anything else unknown is ignored (harmless: metadata, store, service_tier, prediction, ...).
def _off(v) -> bool:
    return v is None or v is False or v == {} or v == [] or v == ""


REFUSED: dict[str, tuple] = {
    "logit_bias": (_off, "token biases are not implemented"),
    "logits_processors": (_off, "logits processors are not implemented"),
    "bad_words": (_off, "bad_words is not implemented"),
    "allowed_token_ids": (_off, "allowed_token_ids is not implemented"),
    "best_of": (lambda v: v in (None, 1), "best_of is not implemented"),
    "use_beam_search": (_off, "beam search is not implemented"),
    "length_penalty": (lambda v: v in (None, 1, 1.0), "length_penalty is not implemented"),
    "typical_p": (lambda v: v in (None, 1, 1.0), "typical_p is not implemented"),
    "top_a": (lambda v: v in (None, 0, 0.0), "top_a is not implemented"),
    "tfs": (lambda v: v in (None, 1, 1.0), "tail-free sampling is not implemented"),
    "mirostat": (lambda v: v in (None, 0), "mirostat is not implemented"),
    "dry_multiplier": (lambda v: v in (None, 0, 0.0), "DRY sampling is not implemented"),
    "xtc_probability": (lambda v: v in (None, 0, 0.0), "XTC sampling is not implemented"),
    "guided_json": (_off, "use response_format with a json_schema"),
    "guided_regex": (_off, "regular-expression constraints are not offered"),
    "guided_choice": (_off, "use response_format with a json_schema enum"),
    "guided_grammar": (_off, "grammar constraints are not offered"),
    "structured_outputs": (_off, "use response_format"),
    "grammar": (_off, "grammar constraints are not offered"),
    "json_schema": (_off, "use response_format"),
    "functions": (_off, "use tools (functions is deprecated)"),
    "function_call": (_off, "use tool_choice (function_call is deprecated)"),
    "audio": (_off, "audio output is not implemented"),
    "modalities": (lambda v: v in (None, ["text"]), "only text output is implemented"),
    "web_search_options": (_off, "web search is not implemented"),
    "reasoning_effort": (_off, "reasoning_effort is not implemented"),
    "verbosity": (_off, "verbosity is not implemented"),
    "include_stop_str_in_output": (_off, "stop strings are always removed"),
    "skip_special_tokens": (lambda v: v in (None, True), "special tokens are always skipped"),
    "spaces_between_special_tokens": (lambda v: v in (None, True), "not implemented"),
    "truncate_prompt_tokens": (_off, "prompts are never truncated; a long one is a 400"),
    "continue_final_message": (_off, "continue_final_message is not implemented"),
    "chat_template": (_off, "the model's own chat template is used"),
    "documents": (_off, "documents are not implemented"),
    "echo": (_off, None),  # completions implements it (declared there); chat does not
}


def _refuse_unimplemented(data: Any, declared: set[str]) -> None:
    if not isinstance(data, dict):
        return
    for name, (harmless, why) in REFUSED.items():
        if name in data and name not in declared and not harmless(data[name]):
            raise field_error(name, f"{name} is not supported" + (f": {why}" if why else ""), "unsupported_parameter")
