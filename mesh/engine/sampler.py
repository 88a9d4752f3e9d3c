"""Batched sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Logprobs are those of the model's raw distribution (before penalties and
temperature), as OpenAI reports them. A seeded request draws its n-th token
from a generator seeded by (seed, n): its tokens depend neither on what else is
in the batch nor on which worker drew the previous ones (a prefill worker draws
the first token, a decode worker the rest, a migrated request resumes anywhere).
"""

from __future__ import annotations

import torch

from mesh.engine.constraints.masks import StepMasks
from mesh.engine.sequence import SampledToken, Sequence, TokenLogprob

_BIG = 1e38


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._seeded = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], masks: StepMasks | None = None) -> list[SampledToken]:
        """``logits [B, V]`` (float32), one row per sequence in ``seqs``; ``masks``: the grammar's allowed
        tokens of the constrained rows (applied after the logprobs, which stay the model's own)."""
        params = [s.params for s in seqs]
        want_lp = [p.logprobs for p in params]
        raw_lp = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_lp) else None
        if masks is not None:
            logits = masks.apply(logits)
        if any(p.has_penalties for p in params):
            logits = logits.clone()
            for i, s in enumerate(seqs):
                if s.params.has_penalties:
                    _apply_penalties(logits[i], s)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            tokens[random_rows] = self._sample(logits[random_rows], [seqs[i] for i in random_rows])
        token_list = tokens.tolist()
        if raw_lp is None:
            return [SampledToken(t) for t in token_list]
        return self._with_logprobs(raw_lp, tokens, token_list, want_lp)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        # Extreme penalties or temperatures may overflow float32; an infinite logit would make NaN
        # probabilities (and a failed step), a huge finite one is simply the winner.
        x = torch.nan_to_num(logits / temps.unsqueeze(1), nan=-_BIG, posinf=_BIG, neginf=-_BIG)
        top_k = [s.params.top_k if s.params.uses_top_k else 0 for s in seqs]
        if any(top_k):
            k = torch.tensor([t if t > 0 else x.shape[1] for t in top_k], device=x.device)
            k = k.clamp(max=x.shape[1])
            sorted_x = x.sort(dim=-1, descending=True).values
            kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        top_p = torch.tensor([s.params.top_p for s in seqs], device=x.device)
        if (top_p < 1.0).any():
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(dim=-1)
            drop_sorted = (cum - sorted_p) > top_p.unsqueeze(1)  # keeps the token that crosses top_p
            drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        min_p = torch.tensor([s.params.min_p for s in seqs], device=x.device)
        if (min_p > 0).any():
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        out = torch.empty(len(seqs), dtype=torch.long, device=x.device)
        unseeded = []
        for i, s in enumerate(seqs):
            if s.params.seed is None:
                unseeded.append(i)
                continue
            self._seeded.manual_seed(token_seed(s.params.seed, s.output_offset + s.num_output_tokens))
            out[i] = torch.multinomial(probs[i], 1, generator=self._seeded)[0]
        if unseeded:
            out[unseeded] = torch.multinomial(probs[unseeded], 1, generator=self.generator).squeeze(1)
        return out

    @staticmethod
    def _with_logprobs(raw_lp, tokens, token_list, want_lp) -> list[SampledToken]:
        chosen = raw_lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        k_max = max((k for k in want_lp if k is not None), default=0)
        top_vals = top_ids = None
        if k_max > 0:
            vals, ids = raw_lp.topk(k_max, dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        out = []
        for i, tok in enumerate(token_list):
            k = want_lp[i]
            if k is None:
                out.append(SampledToken(tok))
                continue
            top = tuple(zip(top_ids[i][:k], top_vals[i][:k], strict=True)) if k and top_ids else ()
            out.append(SampledToken(tok, TokenLogprob(chosen[i], top)))
        return out


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``."""
    return (seed * 6364136223846793005 + (index + 1) * 1442695040888963407) & ((1 << 63) - 1)


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    """In place on one row of logits, as vLLM applies them."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    generated = seq.generated_token_ids
    if (p.presence_penalty or p.frequency_penalty) and generated:
        out = torch.tensor(generated, dtype=torch.long, device=row.device)
        counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
