"""Reasoning models: the thinking block of the output goes to ``reasoning_content``.

Qwen3 and the DeepSeek-R1 distills think inside ``<think>...</think>`` before they answer. A
DeepSeek-R1 distill's template opens the block in the prompt (its generation prompt ends with
``<think>\\n``), so the output starts inside it; Qwen3 writes ``<think>`` itself, and with
``enable_thinking=False`` its template closes an empty block in the prompt, so the output is
all answer. ``ReasoningFormat.starts_inside`` reads that from the rendered prompt.

``ReasoningParser`` splits text as it arrives (tags held back while partial, so any split of the
text gives the same result, as for the tool-call parser). The blanks that frame the block
(``<think>\\n``, ``\\n</think>\\n\\n``) are dropped.

The engine side: a constraint (response_format, a forced tool call) must not apply to the
thinking. ``end_token_id`` is the token that closes the block; the request's ``Constraint`` carries
it as ``start_after``, and the engine's matcher starts with the token after it (free text
before). That needs the end tag to be one token of the vocabulary, as it is in both families.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

WS = " \t\r\n"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    detect: tuple[str, ...] = field(default=("<think>",))

    def starts_inside(self, prompt: str) -> bool:
        """The rendered prompt leaves a thinking block open: the output starts inside it."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def parser(self, prompt: str = "") -> ReasoningParser:
        return ReasoningParser(self, inside=self.starts_inside(prompt))

    def end_token_id(self, token_id: Callable[[str], int | None]) -> int | None:
        """The id of the token that closes the block (None: the tag is not one token)."""
        return token_id(self.end)


THINK = ReasoningFormat("think")  # Qwen3, QwQ, DeepSeek-R1 and its distills
REASONING_FORMATS = {"qwen3": THINK, "deepseek_r1": THINK}


def reasoning_format(chat_template: str | None, override: str | None = None) -> ReasoningFormat | None:
    """The format named by ``override`` ("none": not a reasoning model), else the template's."""
    if override:
        if override == "none":
            return None
        try:
            return REASONING_FORMATS[override]
        except KeyError:
            raise ValueError(f"unknown reasoning format {override!r} "
                             f"(choose from none, {', '.join(REASONING_FORMATS)})") from None
    if chat_template and any(tag in chat_template for tag in THINK.detect):
        return THINK
    return None


class ReasoningParser:
    """``feed(text)`` -> what of it is reasoning and what is content; ``finish()`` at the end."""

    def __init__(self, fmt: ReasoningFormat, inside: bool = False):
        self.fmt = fmt
        # before: the block may still open (only blanks so far); inside; after: all content
        self.mode = "inside" if inside else "before"
        self.held = ""  # a partial tag, or the blanks that may frame the block
        self.fresh = True  # nothing of the current part went out yet (its leading blanks are dropped)
        self.out = ReasoningDelta()

    def feed(self, text: str) -> ReasoningDelta:
        if self.mode == "after" and not self.held:
            self._content(text)  # the common case after thinking: no tags to look for
        else:
            for ch in text:
                self._char(ch)
        out, self.out = self.out, ReasoningDelta()
        return out

    def finish(self) -> ReasoningDelta:
        held, self.held = self.held, ""
        if self.mode == "inside":
            self._reasoning(held.rstrip(WS))
        elif held.strip(WS) or self.mode == "before":
            self._content(held)
        out, self.out = self.out, ReasoningDelta()
        return out

    def _char(self, ch: str) -> None:
        self.held += ch
        if self.mode == "before":
            stripped = self.held.lstrip(WS)
            if stripped.startswith(self.fmt.start):
                self.mode, self.held, self.fresh = "inside", stripped[len(self.fmt.start):], True
                self._settle_inside()
            elif stripped and not self.fmt.start.startswith(stripped):
                self.mode = "after"
                held, self.held = self.held, ""
                self._content(held)
            return
        if self.mode == "inside":
            self._settle_inside()
            return
        self._content(self.held)
        self.held = ""

    def _settle_inside(self) -> None:
        """Inside the block: out goes what cannot be (the start of) the end tag or trailing blanks."""
        end = self.fmt.end
        idx = self.held.find(end)
        if idx >= 0:
            rest = self.held[idx + len(end):]
            self._reasoning(self.held[:idx].rstrip(WS))
            self.mode, self.held, self.fresh = "after", "", True
            if rest:
                self._content(rest)
            return
        keep = _partial_suffix(self.held, end)
        body = self.held[: len(self.held) - keep]
        trimmed = body.rstrip(WS)  # blanks before a possible end tag wait
        self._reasoning(trimmed)
        self.held = body[len(trimmed):] + self.held[len(self.held) - keep:]

    def _reasoning(self, text: str) -> None:
        if self.fresh:
            text = text.lstrip(WS)
            if not text:
                return
            self.fresh = False
        self.out.reasoning += text

    def _content(self, text: str) -> None:
        if self.fresh and self.mode == "after":
            text = text.lstrip(WS)
            if not text:
                return
        self.fresh = False
        self.out.content += text


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
