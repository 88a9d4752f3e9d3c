"""The drafting rows of one step: each position's logits processed as decoding would process them
there, verified, and their logprobs (speculative decoding; ``engine.spec.verify`` has the rules).

A drafting row computes ``1 + len(drafts)`` positions: its last real token's, then each draft's.
Position j stands where the row would be had it taken drafts[:j], so it gets what decoding would
apply there (vLLM's rejection sampler sees the same processed logits):

- its grammar's mask in the state after those drafts (``GrammarManager.draft_masks``: the drafts
  walked through the matcher and rolled back; the scheduler already cut them at the first token
  the grammar refuses);
- EOS and stop ids held back while the output, drafts included, is short of ``min_tokens``;
- penalties counting those drafts as generated tokens (``Sampler.process_positions``).

A greedy row then emits the argmax of each position up to the first rejected draft, so its tokens
are those of decoding without speculation; a sampled row's rejection sampling draws from the
processed distributions. Logprobs are those of the model's raw distribution at each emitted
token's position, as without speculation.

    launch (engine thread, step queued)        emit (the step's tokens on the host)
    -----------------------------------        ------------------------------------
    gather the rows' positions' logits          greedy rows: accept_greedy over the argmaxes
    masks, min_tokens, penalties                sampled rows: the tokens drawn at launch
    argmax of every position; rejection         each emitted token's logprob (copies landed)
      sampling of sampled rows; logprobs
      gathered, copies to the host started
"""

from __future__ import annotations

import torch

from engine.constraints.manager import GrammarManager
from engine.constraints.masks import StepMasks, apply_bitmask
from engine.hostcopy import to_device
from engine.sampler import Sampler
from engine.sequence import SampledToken, Sequence, TokenLogprob
from engine.spec.verify import accept_greedy

Drafting = list[tuple[int, list[int] | tuple[int, ...]]]  # per drafting row: its index in the step's samples, its drafts


class Verification:
    """The drafting rows of one launched step: verified at launch (``launch``), emitted by ``emit``."""

    def __init__(self, drafting: Drafting, argmax: torch.Tensor, sampled: dict[int, list[int]],
                 logprobs: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]]):
        self.drafting = drafting
        self._argmax = _to_host(argmax)  # every position's processed argmax, rows in order
        self._sampled = sampled  # sampled rows: the tokens rejection sampling emits, by index
        self._logprobs = {i: (_to_host(c), _to_host(t)) for i, (c, t) in logprobs.items()}

    @classmethod
    def launch(cls, sampler: Sampler, grammar: GrammarManager | None, logits: torch.Tensor, n: int,
               drafting: Drafting, seqs: list[Sequence], masks: StepMasks | None = None) -> Verification:
        """``logits``: the step's sampled rows (``n``), then its drafted positions in order; read
        before the sampler masks the sampled rows in place. ``masks``: the step's (their fill, in a
        thread, walks the matchers the drafted positions' masks walk: it must be done first)."""
        if masks is not None:
            masks.wait()
        index, at = [], n
        for i, drafts in drafting:
            index.append(i)
            index.extend(range(at, at + len(drafts)))
            at += len(drafts)
        raw = logits.index_select(0, to_device(index, torch.long, logits.device))
        x = _processed(sampler, grammar, raw, drafting, seqs)
        argmax = x.argmax(dim=-1)
        sampled, logprobs, start = {}, {}, 0
        for i, drafts in drafting:
            seq, end = seqs[i], start + len(drafts) + 1
            if not seq.params.greedy:
                sampled[i] = sampler.sample_drafted(x[start:end], seq, drafts)
            k = seq.params.logprobs
            if k is not None:
                emitted = argmax[start:end] if i not in sampled else to_device(
                    sampled[i] + [0] * (end - start - len(sampled[i])), torch.long, x.device)
                logprobs[i] = _gather_logprobs(raw[start:end], emitted, k)
            start = end
        return cls(drafting, argmax, sampled, logprobs)

    def emit(self, tokens: list[SampledToken]) -> list[SampledToken]:
        """``tokens``: the step's sampled tokens on the host (their copy landed, and with it this
        step's); each drafting row's replaced by what it emits (``SampledToken.then``)."""
        argmax = self._argmax.tolist()
        start = 0
        for i, drafts in self.drafting:
            end = start + len(drafts) + 1
            emitted = self._sampled.get(i) or accept_greedy(list(drafts), argmax[start:end])
            lps = self._row_logprobs(i, len(emitted))
            tokens[i] = SampledToken(emitted[0], lps[0] if lps else None, tuple(emitted[1:]), tuple(lps[1:]))
            start = end
        return tokens

    def _row_logprobs(self, i: int, count: int) -> list[TokenLogprob]:
        if i not in self._logprobs:
            return []
        chosen, top = self._logprobs[i]
        chosen = chosen.tolist()[:count]
        if top is None:
            return [TokenLogprob(c) for c in chosen]
        vals, ids = (t.tolist() for t in top)
        return [TokenLogprob(c, tuple(zip(ids[j], vals[j], strict=True))) for j, c in enumerate(chosen)]


def _processed(sampler: Sampler, grammar: GrammarManager | None, raw: torch.Tensor, drafting: Drafting,
               seqs: list[Sequence]) -> torch.Tensor:
    """``raw``'s positions with each row's masks, min_tokens and penalties (a copy where any applies)."""
    masks = grammar.draft_masks([(seqs[i].grammar, d) for i, d in drafting]) if grammar is not None else None
    x = raw
    if masks is not None:
        x = raw.clone()
        apply_bitmask(x, *masks)
    start = 0
    for i, drafts in drafting:
        seq, end = seqs[i], start + len(drafts) + 1
        p = seq.params
        if p.has_penalties or (p.min_tokens and seq.num_output_tokens_scheduled < p.min_tokens):
            if x is raw:
                x = raw.clone()
            x[start:end] = sampler.process_positions(x[start:end], seq, drafts)
        start = end
    return x


def _gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int):
    """(each token's logprob, (top-k values, their ids) or None) under ``raw``'s distributions."""
    lp = torch.log_softmax(raw, dim=-1)
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return chosen, (tuple(lp.topk(k, dim=-1)) if k > 0 else None)


def _to_host(t):
    """Start a tensor's (or a pair's) copy to the host; read once the step's samples synchronized."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_to_host(x) for x in t)
    return t.to("cpu", non_blocking=True) if t.device.type == "cuda" else t
