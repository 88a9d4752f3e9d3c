"""Batched sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Logprobs are those of the model's raw distribution (before penalties and
temperature), as OpenAI reports them. A seeded request draws its n-th token
from a generator seeded by (seed, n): its tokens depend neither on what else is
in the batch nor on which worker drew the previous ones (a prefill worker draws
the first token, a decode worker the rest, a migrated request resumes anywhere).

Nothing here waits for the device: the sampled ids stay on it (``SampledBatch``;
with overlapped scheduling they are the next step's inputs) and one copy per
step brings them, and the logprobs when asked, to the host; ``to_host`` waits
for that copy. Host-side decisions (which rows filter, which are seeded) are
made from the requests' parameters, never from device values.
"""

from __future__ import annotations

import torch

from engine.constraints.masks import StepMasks
from engine.hostcopy import to_device
from engine.kernels import PLAIN, Kernels
from engine.sequence import SampledToken, Sequence, TokenLogprob
from engine.spec.verify import rejection_sample

_BIG = 1e38


class SampledBatch:
    """One step's sampled token ids on the device, and their copy to the host, started at once."""

    def __init__(self, tokens: torch.Tensor, want_lp: list[int | None],
                 logprobs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None):
        self.tokens = tokens  # [B] int64 on the device
        self._want_lp = want_lp
        chosen, top_vals, top_ids = logprobs or (None, None, None)
        self._host = [_start_copy(t) for t in (tokens, chosen, top_vals, top_ids)]
        self._ready = None
        if tokens.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to_host(self) -> list[SampledToken]:
        """The tokens (with logprobs where asked), once the copy has landed."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens, chosen, top_vals, top_ids = self._host
        token_list = tokens.tolist()
        if chosen is None:
            return [SampledToken(t) for t in token_list]
        chosen_list = chosen.tolist()
        vals = top_vals.tolist() if top_vals is not None else None
        ids = top_ids.tolist() if top_ids is not None else None
        out = []
        for i, tok in enumerate(token_list):
            k = self._want_lp[i]
            if k is None:
                out.append(SampledToken(tok))
                continue
            top = tuple(zip(ids[i][:k], vals[i][:k], strict=True)) if k and ids else ()
            out.append(SampledToken(tok, TokenLogprob(chosen_list[i], top)))
        return out


def _start_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, kernels: Kernels = PLAIN,
                 eos_token_ids: tuple[int, ...] = ()):
        self.device = device
        self.eos_token_ids = eos_token_ids  # held back, with stop ids, from rows short of min_tokens
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._seeded = torch.Generator(device=device)
        self.kernels = kernels  # kernels.top_k_top_p: a fused sampler for unseeded rows, or None

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], masks: StepMasks | None = None) -> list[SampledToken]:
        """``logits [B, V]`` (float32), one row per sequence in ``seqs``; waits for the tokens."""
        return self.sample(logits, seqs, masks).to_host()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], masks: StepMasks | None = None) -> SampledBatch:
        """Sample one token per row, leaving them on the device (the copy to the host is started).
        ``masks``: the grammar's allowed tokens of the constrained rows (applied after the logprobs,
        which stay the model's own)."""
        params = [s.params for s in seqs]
        want_lp = [p.logprobs for p in params]
        raw_lp = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_lp) else None
        if masks is not None:
            logits = masks.apply(logits)
        short = [(i, s) for i, s in enumerate(seqs)
                 if s.params.min_tokens and s.num_output_tokens_scheduled < s.params.min_tokens]
        if short:
            logits = self._hold_back_stops(logits, short)
        if any(p.has_penalties for p in params):
            logits = logits.clone()
            for i, s in enumerate(seqs):
                if s.params.has_penalties:
                    _apply_penalties(logits[i], s)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = self._index(random_rows)
            tokens.index_copy_(0, rows, self._sample(logits.index_select(0, rows), [seqs[i] for i in random_rows]))
        if raw_lp is None:
            return SampledBatch(tokens, want_lp)
        return SampledBatch(tokens, want_lp, _logprobs(raw_lp, tokens, want_lp))

    def sample_drafted(self, logits: torch.Tensor, seq: Sequence, drafts: list[int] | tuple[int, ...]) -> list[int]:
        """Rejection sampling of a drafting row (``engine.spec.verify``): ``logits [len(drafts) + 1, V]``
        at its last real position and each drafted one; the tokens it emits. A seeded row draws from
        a generator seeded by (seed, index of the step's first token), so its output is reproducible."""
        p = seq.params
        x = torch.nan_to_num(logits / p.temperature, nan=-_BIG, posinf=_BIG, neginf=-_BIG)
        probs = self._filtered_probs(x, [seq] * x.shape[0])
        gen = self.generator
        if p.seed is not None:
            gen = self._seeded
            gen.manual_seed(token_seed(p.seed, seq.output_offset + seq.num_output_tokens_scheduled))
        return rejection_sample(probs, list(drafts), gen)

    def process_positions(self, x: torch.Tensor, seq: Sequence, drafts: list[int] | tuple[int, ...]) -> torch.Tensor:
        """A drafting row's logits at its last real position and at each drafted one (``[len(drafts) + 1,
        V]``, its grammar's masks applied) as ``sample`` would process each position after the drafts
        before it were taken: stop ids held back below ``min_tokens``, penalties counting those drafts."""
        p = seq.params
        first = seq.num_output_tokens_scheduled  # the output index of the token position 0 emits
        if p.min_tokens and first < p.min_tokens:
            x = self._hold_back_stops(x, [(j, seq) for j in range(min(x.shape[0], p.min_tokens - first))])
        if p.has_penalties:
            x = _penalize_positions(x, seq, drafts)
        return x

    def _hold_back_stops(self, logits: torch.Tensor, short: list[tuple[int, Sequence]]) -> torch.Tensor:
        """EOS (unless ignored) and stop ids cannot be drawn by rows short of ``min_tokens`` (vLLM's rule)."""
        rows, cols = [], []
        vocab = logits.shape[1]
        for i, s in short:
            stops = set(s.params.stop_token_ids)
            if not s.params.ignore_eos:
                stops.update(self.eos_token_ids)
            for t in stops:
                if t < vocab:
                    rows.append(i)
                    cols.append(t)
        if not cols:
            return logits
        logits = logits.clone()
        logits[self._index(rows), self._index(cols)] = float("-inf")
        return logits

    def _index(self, rows: list[int]) -> torch.Tensor:
        return to_device(rows, torch.long, self.device)

    def _tensor(self, values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temps = self._tensor([s.params.temperature for s in seqs])
        # Extreme penalties or temperatures may overflow float32; an infinite logit would make NaN
        # probabilities (and a failed step), a huge finite one is simply the winner.
        x = torch.nan_to_num(logits / temps.unsqueeze(1), nan=-_BIG, posinf=_BIG, neginf=-_BIG)
        out = torch.empty(len(seqs), dtype=torch.long, device=x.device)
        fused = self.kernels.top_k_top_p
        # the fused sampler serves unseeded rows without min-p (it has no per-row generator, no min-p)
        fast = [i for i, s in enumerate(seqs) if fused is not None and s.params.seed is None and s.params.min_p == 0]
        if fast:
            vocab = x.shape[1]
            sub = [seqs[i] for i in fast]
            top_k = self._tensor([min(s.params.top_k, vocab) if s.params.uses_top_k else vocab for s in sub], torch.int32)
            top_p = self._tensor([s.params.top_p for s in sub])
            rows = self._index(fast)
            out.index_copy_(0, rows, fused(x.index_select(0, rows), top_k, top_p, self.generator))
            if len(fast) == len(seqs):
                return out
        taken = set(fast)
        rest = [i for i in range(len(seqs)) if i not in taken]
        sub = [seqs[i] for i in rest]
        rows = self._index(rest) if fast else None
        probs = self._filtered_probs(x if rows is None else x.index_select(0, rows), sub)
        draws = torch.empty(len(sub), dtype=torch.long, device=x.device)
        unseeded = []
        for j, s in enumerate(sub):
            if s.params.seed is None:
                unseeded.append(j)
                continue
            self._seeded.manual_seed(token_seed(s.params.seed, s.output_offset + s.num_output_tokens_scheduled))
            draws[j] = torch.multinomial(probs[j], 1, generator=self._seeded)[0]
        if unseeded:
            pick = self._index(unseeded)
            draws.index_copy_(0, pick, torch.multinomial(probs.index_select(0, pick), 1, generator=self.generator).squeeze(1))
        if rows is None:
            return draws
        return out.index_copy_(0, rows, draws)

    def _filtered_probs(self, x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """softmax(x) with top-k, then top-p, then min-p applied per row (PyTorch, sort-based)."""
        top_k = [s.params.top_k if s.params.uses_top_k else 0 for s in seqs]
        if any(top_k):
            k = self._tensor([min(t, x.shape[1]) if t > 0 else x.shape[1] for t in top_k], torch.long)
            sorted_x = x.sort(dim=-1, descending=True).values
            kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if any(s.params.top_p < 1.0 for s in seqs):
            top_p = self._tensor([s.params.top_p for s in seqs])
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(dim=-1)
            drop_sorted = (cum - sorted_p) > top_p.unsqueeze(1)  # keeps the token that crosses top_p
            drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if any(s.params.min_p > 0 for s in seqs):
            min_p = self._tensor([s.params.min_p for s in seqs])
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs


def _logprobs(raw_lp: torch.Tensor, tokens: torch.Tensor, want_lp: list[int | None]):
    """(chosen token's logprob [B], top-k logprobs [B, k], their ids [B, k]) on the device."""
    chosen = raw_lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k_max = max((k for k in want_lp if k is not None), default=0)
    if k_max <= 0:
        return chosen, None, None
    vals, ids = raw_lp.topk(k_max, dim=-1)
    return chosen, vals, ids


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``."""
    return (seed * 6364136223846793005 + (index + 1) * 1442695040888963407) & ((1 << 63) - 1)


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    """In place on one row of logits, as vLLM applies them (reads every token: the engine resolves
    in-flight tokens before a step with penalties)."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = to_device(sorted(set(seq.token_ids)), torch.long, row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    generated = seq.generated_token_ids
    if (p.presence_penalty or p.frequency_penalty) and generated:
        out = to_device(generated, torch.long, row.device)
        counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _penalize_positions(x: torch.Tensor, seq: Sequence, drafts: list[int] | tuple[int, ...]) -> torch.Tensor:
    """``_apply_penalties`` at each of a drafting row's positions: position j also counts the j drafts
    before it (the tokens the row has taken there if they are accepted). The same arithmetic, so a
    greedy row picks what it would without speculation."""
    p = seq.params
    n, vocab = x.shape
    ahead = torch.zeros((n, vocab), dtype=x.dtype, device=x.device)  # row j: counts of drafts[:j]
    if drafts:
        d = to_device(list(drafts), torch.long, x.device)
        ahead[1:] = torch.nn.functional.one_hot(d, vocab).to(x.dtype).cumsum(0)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=x.device)
        seen[to_device(sorted(set(seq.token_ids)), torch.long, x.device)] = True
        r = p.repetition_penalty
        x = torch.where(seen | (ahead > 0), torch.where(x > 0, x / r, x * r), x)
    if p.presence_penalty or p.frequency_penalty:
        counts = ahead
        generated = seq.generated_token_ids
        if generated:
            counts = counts + torch.bincount(to_device(generated, torch.long, x.device), minlength=vocab).to(x.dtype)
        x = x - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype))
    return x
