"""Stop strings inside a draft (issue 34): a verification step delivers several tokens at once,
and a stop string may end at any of them. The gateway looks for it token by token, so text,
token ids and usage are what the same tokens give one per chunk (decoding without speculation)."""

from __future__ import annotations

import pytest

from gateway.service import _ChoiceText
from mesh.protocol import TokenChunk
from mesh.tokenizer import Tokenizer

IDS = [345, 1200, 87, 2222, 999, 1501, 640, 3011]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


def run(tok, chunks: list[list[int]], stops: list[str], min_tokens: int = 0):
    """Text, token ids, completion tokens and finish reason of a choice fed ``chunks``."""
    choice = _ChoiceText(0, tok, stops, prompt_tokens=5, min_tokens=min_tokens)
    text, ids, reason, usage = "", [], None, None
    for i, c in enumerate(chunks):
        last = i == len(chunks) - 1
        d = choice.delta([TokenChunk("r", i, c, finish_reason="length" if last else None)])
        text, ids = text + d.text, ids + d.token_ids
        reason, usage = d.finish_reason, d.usage
        if reason is not None:
            break
    return text, ids, usage.completion_tokens, reason


@pytest.mark.parametrize("at", [1, 3, 6, 7])  # the stop string ends at the draft's first, a middle or its last token
def test_a_stop_string_ending_inside_a_draft_cuts_there(tok, at):
    pieces = [tok.decode([t], True) for t in IDS]
    stop = pieces[at - 1][-1:] + pieces[at]  # spans two tokens, completed by token ``at``
    assert stop and "".join(pieces[:at]).find(stop) < 0 <= "".join(pieces[:at + 1]).find(stop)
    one_by_one = run(tok, [[t] for t in IDS], [stop])
    drafted = run(tok, [IDS[:1], IDS[1:]], [stop])  # the first token, then a step's accepted drafts
    assert drafted == one_by_one
    assert drafted[1] == IDS[:at + 1] and drafted[2] == at + 1 and drafted[3] == "stop"
    assert drafted[0] == "".join(pieces)[:"".join(pieces).find(stop)]


def test_min_tokens_and_no_stop(tok):
    pieces = [tok.decode([t], True) for t in IDS]
    stop = pieces[1]
    # before min_tokens a stop string does not count (vLLM's): the second occurrence would, there is none
    assert run(tok, [IDS[:1], IDS[1:]], [stop], min_tokens=4) == run(tok, [[t] for t in IDS], [stop], min_tokens=4)
    assert run(tok, [IDS[:1], IDS[1:]], ["never in it"]) == ("".join(pieces), IDS, len(IDS), "length")
