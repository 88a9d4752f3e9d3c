"""A Responses request as the chat request the chat path serves, and items as chat messages.

    instructions                      -> a system message (not carried to the next response)
    stored history (previous_response_id), then the input items:
      message (user/system/developer) -> a message of that role (developer: system, which every
                                         template renders)
      message (assistant)             -> an assistant message
      reasoning                       -> the next assistant message's reasoning_content
      function_call                   -> a tool call of an assistant message (consecutive calls, and
                                         calls after an assistant message, join that message)
      function_call_output            -> a tool message answering call_id
    tools, tool_choice, text.format   -> tools, tool_choice, response_format
    max_output_tokens                 -> max_completion_tokens

A response's output items are valid input items, so a stored conversation's history is the chat
messages of its inputs and outputs (``output_messages``), and a client that feeds the output
back itself gets the same prompt as one that names ``previous_response_id``.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from gateway import errors
from gateway.errors import APIError
from gateway.requests.schemas import ChatCompletionRequest
from gateway.responses.schema import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextFormat,
)

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# a chat field named in a validation error -> the Responses field the client sent
PARAMS = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
          ("response_format", "text.format"), ("function.", ""))


def input_messages(items: list) -> list[dict]:
    """Chat messages (as ``ChatMessage`` takes them) of Responses items."""
    messages: list[dict] = []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
            continue
        if isinstance(item, MessageItem):
            message = {"role": ROLES[item.role], "content": item.text()}
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            message = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
            if message is None:
                message = {"role": "assistant", "content": None}
                messages.append(message)
            message.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            continue
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
            reasoning = None
    return messages


def output_messages(output: list[dict]) -> list[dict]:
    """The chat messages of a response's output items (its reasoning, message and calls)."""
    items = []
    for item in output:
        kind = item["type"]
        if kind == "message":
            items.append(MessageItem(role="assistant", content="".join(p["text"] for p in item["content"])))
        elif kind == "function_call" and _is_json(item["arguments"]):  # a call cut short cannot be rendered
            items.append(FunctionCallItem(type="function_call", call_id=item["call_id"], name=item["name"],
                                          arguments=item["arguments"]))
        elif kind == "reasoning":
            items.append(ReasoningItem.model_validate(item, strict=False))
    return input_messages(items)


def _is_json(text: str) -> bool:
    try:
        json.loads(text or "{}")
    except json.JSONDecodeError:
        return False
    return True


def new_messages(body: ResponsesRequest) -> list[dict]:
    """The messages this request adds to its conversation (its input; not its instructions)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    return input_messages(body.input)


def chat_request(body: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat request of ``body`` continuing ``history`` (400s name the Responses fields)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict = {"model": body.model, "messages": [*messages, *history, *new_messages(body)],
                  "stream": body.stream, "priority": body.priority}
    for name, value in (("max_completion_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("parallel_tool_calls", body.parallel_tool_calls),
                        ("user", body.user), ("response_format", _response_format(body.text_format))):
        if value is not None:
            chat[name] = value
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    if isinstance(body.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        raise renamed(errors.from_pydantic(e)) from None


def _response_format(fmt: TextFormat | None) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema_ is None:
        raise APIError(400, "text.format of type json_schema needs a name and a schema", "text.format",
                       "missing_required_parameter")
    spec = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def renamed(e: APIError) -> APIError:
    """An error of the chat request (validation, template, limits), naming the Responses field it
    came from."""
    if e.param:
        param = e.param
        for chat, ours in PARAMS:
            param = param.replace(chat, ours)
        e.message = e.message.replace(e.param, param)
        e.param = param
    return e
