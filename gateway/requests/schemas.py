"""OpenAI request bodies, validated the way OpenAI validates them.

Unknown fields are ignored (as OpenAI's server ignores them), except those that
would change what the model must produce and that we do not implement
(``REFUSED``): those are a 400 naming the field, never silently dropped. A known
field with a bad value is a 400 naming the field. Types are strict (``true`` is
not the integer 1, ``"2"`` is not 2) and every number has a bound, so nothing a
client sends can overflow the wire codec or the sampler further in.

Structured output (``response_format``, ``tools``, ``tool_choice``,
``parallel_tool_calls``) is parsed into typed fields and checked here: schemas
the grammar engine cannot enforce, unknown tool names, tool choices without
tools are 400s. ``gateway.outputs.plan`` turns them into the request's output plan.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.requests.output_schemas import (
    MAX_TOOLS,
    FunctionDefinition,
    MessageToolCall,
    NamedToolChoice,
    ResponseFormat,
    ToolDefinition,
    _refuse_unimplemented,
    field_error,
)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_TOKEN_ID = (1 << 31) - 1
# Below this a temperature is greedy: logits / 1e-30 overflow float32 and sampling would fail.
GREEDY_BELOW = 1e-5
MAX_STOP_CHARS = 1000  # per stop sequence (OpenAI documents no cap; ours keeps the matching cheap)

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=256)
    reasoning_content: str | None = None  # an earlier turn's thinking, for templates that show it

    @model_validator(mode="after")
    def _roles(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict:
        """The message as Hugging Face chat templates expect it: only the keys it has (templates test
        ``'tool_calls' in message``)."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class SamplingFields(BaseModel):
    """Fields shared by chat and completions."""

    model_config = _STRICT

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOKEN_ID)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)  # vLLM's: EOS, stop ids and stop strings wait for this many tokens
    speculate: bool = True  # false: no speculative decoding for this request (where the worker has it)
    user: str | None = None
    priority: int = Field(default=0, ge=-(1 << 31), le=(1 << 31) - 1)
    # vLLM's: prefixes are cached and reused only among requests with the same salt (and tenant)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    return_token_ids: bool = False  # vLLM's extension: token_ids (and prompt_token_ids) in each choice
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        _refuse_unimplemented(data, set(cls.model_fields))
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list):
            if len(v) > 4:
                raise ValueError("at most 4 stop sequences are allowed")
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty")
        elif v == "":
            raise ValueError("stop sequences must be non-empty")
        # the gateway matches every stop against each new text on its event loop: a long one costs
        # every stream's latency (four of 250k characters: 0.86 ms per token)
        if any(len(s) > MAX_STOP_CHARS for s in ([v] if isinstance(v, str) else v or [])):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters each")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def choice_seed(self, k: int) -> int | None:
        """Choice ``k``'s seed: distinct per choice, reproducible, still an int64."""
        if self.seed is None:
            return None
        return ((self.seed + k - INT64_MIN) % (1 << 64)) + INT64_MIN

    @property
    def sampling_temperature(self) -> float:
        t = 1.0 if self.temperature is None else self.temperature
        return 0.0 if t < GREEDY_BELOW else t

    @property
    def wants_json(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
RESERVED_TEMPLATE_VARS = {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # extra template variables (``enable_thinking``), as vLLM takes them

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _tools(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise field_error("tools", "tool names must be unique")
        if not names:
            for field in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, field) is not None:
                    raise field_error(field, f"{field} is only allowed when tools are specified")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise field_error("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not "
                                             "one of the tools")
        if self.tool_choice_mode == "auto" and self.wants_json:
            raise field_error("response_format", "response_format with tools the model may call "
                                                 "(tool_choice auto) is not supported", "unsupported_parameter")
        for key in self.chat_template_kwargs or {}:
            if not key.isidentifier() or key.startswith("_") or key in RESERVED_TEMPLATE_VARS:
                raise field_error("chat_template_kwargs", f"chat_template_kwargs cannot set {key!r}")
        return self

    @property
    def tool_choice_mode(self) -> str:
        """none, auto, required or named; OpenAI's default: auto with tools, none without."""
        if not self.tools:
            return "none"
        if self.tool_choice is None:
            return "auto"
        return "named" if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice

    @property
    def forced_tools(self) -> list[FunctionDefinition]:
        """The functions a call must be to (required: any of them; named: that one)."""
        mode = self.tool_choice_mode
        functions = [t.function for t in self.tools or []]
        if mode == "required":
            return functions
        if mode == "named":
            return [f for f in functions if f.name == self.tool_choice.function.name]
        return []

    @property
    def parallel(self) -> bool:
        return self.parallel_tool_calls is not False

    def template_messages(self) -> list[dict]:
        return [m.template_dict() for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        return [t.template_dict() for t in self.tools] if self.tools else None

    @property
    def max_output(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


PromptType = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingFields):
    prompt: PromptType
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if all(isinstance(x, list) for x in v) and any(not x for x in v):
                raise ValueError("token-id prompts must not be empty")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    @property
    def max_output(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def openapi_body(model: type[BaseModel]) -> dict:
    """A route's request body in the OpenAPI document (the handlers parse the body themselves); the
    app moves ``x-components`` where the schema's references point."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "x-components": defs}
