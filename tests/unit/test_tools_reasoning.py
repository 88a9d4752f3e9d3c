"""Reasoning output: the thinking block goes to reasoning_content, whole or streamed at any split."""

from __future__ import annotations

import codecs

import pytest

from gateway.outputs.reasoning import THINK, ReasoningDelta, ReasoningParser, reasoning_format

CASES = [  # prompt, output, reasoning, content
    ("<|im_start|>assistant\n", "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nIt is **4**.",
     "The user wants 2+2. That is 4.", "It is **4**."),
    ("<｜Assistant｜><think>\n",  # noqa: RUF001 - DeepSeek's own token spelling
     "Hmm, < and > are not tags; </thin is not either.\n</think>\n\nDone — ✓",
     "Hmm, < and > are not tags; </thin is not either.", "Done — ✓"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Straight to the answer.", "", "Straight to the answer."),
    ("<|im_start|>assistant\n", "No thinking here, <think> mid-text stays.", "", "No thinking here, <think> mid-text stays."),
    ("<|im_start|>assistant\n", "<think>\nstill thinking when max_tokens hit", "still thinking when max_tokens hit", ""),
    ("<|im_start|>assistant\n", "  <think>Indented.</think>Answer", "Indented.", "Answer"),
]


def run(prompt: str, chunks: list[str]) -> tuple[str, str]:
    p = THINK.parser(prompt)
    deltas = [p.feed(c) for c in chunks] + [p.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize("prompt, text, reasoning, content", CASES)
def test_whole_and_every_split(prompt, text, reasoning, content):
    assert run(prompt, [text]) == (reasoning, content)
    for i in range(len(text) + 1):
        assert run(prompt, [text[:i], text[i:]]) == (reasoning, content), i
    assert run(prompt, list(text)) == (reasoning, content)
    data = text.encode()
    dec = codecs.getincrementaldecoder("utf-8")()
    assert run(prompt, [dec.decode(data[i:i + 1]) for i in range(len(data))]) == (reasoning, content)


def test_reasoning_streams_before_the_block_closes():
    p = ReasoningParser(THINK)
    first = p.feed("<think>\nStep one. Step two")
    assert first == ReasoningDelta(reasoning="Step one. Step two")
    assert p.feed(" and three.\n</th") == ReasoningDelta(reasoning=" and three.")  # blanks and partial tag held
    assert p.feed("ink>\n\nAnswer") == ReasoningDelta(content="Answer")


def test_the_output_starts_inside_when_the_prompt_left_the_block_open():
    assert THINK.starts_inside("<｜User｜>hi<｜Assistant｜><think>\n")  # noqa: RUF001
    assert not THINK.starts_inside("<|im_start|>assistant\n")
    assert not THINK.starts_inside("<think>\nold</think>\nanswer<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_format_comes_from_the_template_or_the_override():
    assert reasoning_format("{% if enable_thinking %}<think>{% endif %}") is THINK
    assert reasoning_format("{{ messages }}") is None
    assert reasoning_format("<think>", "none") is None
    assert reasoning_format(None, "deepseek_r1") is THINK
    with pytest.raises(ValueError, match="unknown reasoning format"):
        reasoning_format(None, "o1")


def test_the_end_tag_must_be_one_token_for_the_engine():
    vocab = {"</think>": 151668}
    assert THINK.end_token_id(vocab.get) == 151668
    assert THINK.end_token_id({}.get) is None
