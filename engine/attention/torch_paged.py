"""Paged attention in plain PyTorch: the CPU backend and the numerical reference.

Decode rows (one query token per sequence) are batched into one SDPA call over
the gathered, padded contexts; prefill chunks run one SDPA per sequence with a
causal mask offset by the tokens already in the cache. Rows of a few query tokens
after a cached context (speculative decoding's verification: the last token and
its drafts) join the decode batch, their queries padded to the longest such row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBatch, register
from kvstore.cache import KVCache

SHORT_QUERY = 8  # rows of up to this many query tokens after a cached context batch with the decode rows


@dataclass
class _Prefill:
    row: int
    qlen: int
    ctx: int
    blocks: torch.Tensor
    mask: torch.Tensor | None  # None when the chunk is the whole context (plain causal)


class TorchPagedAttention:
    name = "torch"

    def __init__(self, kv: KVCache, scale: float):
        self.kv = kv
        self.scale = scale
        self.block_size = kv.spec.block_size

    def plan(self, batch: AttentionBatch) -> None:
        device = self.kv.device
        bs = self.block_size
        self._slots = batch.slot_mapping
        dec_rows, dec_ctx, dec_tables, dec_qlens = [], [], [], []
        self._prefills: list[_Prefill] = []
        row = 0
        for qlen, ctx, table in zip(batch.query_lens, batch.context_lens, batch.block_tables, strict=True):
            nblk = -(-ctx // bs)
            if qlen == 1 or (qlen <= SHORT_QUERY and ctx > qlen):
                dec_rows.append(row)
                dec_ctx.append(ctx)
                dec_tables.append(table[:nblk])
                dec_qlens.append(qlen)
            else:
                mask = None
                if ctx != qlen:
                    q_pos = torch.arange(ctx - qlen, ctx, device=device).unsqueeze(1)
                    mask = torch.arange(ctx, device=device).unsqueeze(0) <= q_pos
                blocks = torch.as_tensor(table[:nblk], dtype=torch.long, device=device)
                self._prefills.append(_Prefill(row, qlen, ctx, blocks, mask))
            row += qlen
        self._num_decode = len(dec_rows)
        self._qmax = max(dec_qlens, default=1)
        self._all_decode = self._num_decode == len(batch.query_lens) and self._qmax == 1
        if dec_rows:
            maxb = max(len(t) for t in dec_tables)
            # padded in Python, then one tensor: a copy per row was a small op (and a GIL release) per row
            table = torch.tensor([t + [0] * (maxb - len(t)) for t in dec_tables], dtype=torch.long)
            self._dec_table = table.flatten().to(device)  # [n * maxb]: one index_select per layer
            self._dec_rows = torch.as_tensor(dec_rows, dtype=torch.long, device=device)
            ctx_t = torch.as_tensor(dec_ctx, device=device)
            positions = torch.arange(maxb * bs, device=device)
            self._dec_mask = (positions.unsqueeze(0) < ctx_t.unsqueeze(1))[:, None, None, :]
            if self._qmax > 1:
                self._plan_short(dec_rows, dec_qlens, ctx_t, positions)

    def _plan_short(self, rows: list[int], qlens: list[int], ctx: torch.Tensor, positions: torch.Tensor) -> None:
        """Decode rows with several query tokens: each padded to ``qmax`` queries (a pad repeats the
        row's last one, and its output is dropped), a causal mask offset by the row's cached context."""
        device, qmax = self.kv.device, self._qmax
        gather, keep, dest = [], [], []
        for j, (row, qlen) in enumerate(zip(rows, qlens, strict=True)):
            gather.extend(row + min(i, qlen - 1) for i in range(qmax))
            keep.extend(j * qmax + i for i in range(qlen))
            dest.extend(range(row, row + qlen))
        self._short_gather = torch.as_tensor(gather, dtype=torch.long, device=device)
        self._short_keep = torch.as_tensor(keep, dtype=torch.long, device=device)
        self._short_dest = torch.as_tensor(dest, dtype=torch.long, device=device)
        q_pos = (ctx - torch.as_tensor(qlens, device=device)).unsqueeze(1) + torch.arange(qmax, device=device)
        q_pos = torch.minimum(q_pos, (ctx - 1).unsqueeze(1))  # pads attend as the last query does
        self._dec_mask = (positions[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)  # [n, 1, qmax, keys]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv.layer(layer)
        heads, dim = k_cache.shape[2], k_cache.shape[3]
        # index_copy_/index_select on flat views: several times faster than advanced indexing
        k_cache.view(-1, heads, dim).index_copy_(0, self._slots, k)
        v_cache.view(-1, heads, dim).index_copy_(0, self._slots, v)
        return self.attend(q, k_cache, v_cache)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Each row of ``q [T, Hq, D]`` over its sequence's cached keys and values (pages
        ``[blocks, block_size, heads, D]`` and ``[..., Dv]``: Dv may differ from D), ``[T, Hq, Dv]``."""
        heads, dim = k_cache.shape[2], k_cache.shape[3]
        if self._all_decode:
            return self._decode(q, k_cache, v_cache, heads, dim)
        out = q.new_empty(*q.shape[:2], v_cache.shape[3])
        if self._num_decode and self._qmax > 1:
            out.index_copy_(0, self._short_dest, self._short(q, k_cache, v_cache, heads, dim))
        elif self._num_decode:
            out[self._dec_rows] = self._decode(q[self._dec_rows], k_cache, v_cache, heads, dim)
        for p in self._prefills:
            keys = k_cache.index_select(0, p.blocks).view(-1, heads, dim)[: p.ctx].transpose(0, 1)
            vals = v_cache.index_select(0, p.blocks).view(-1, heads, v_cache.shape[3])[: p.ctx].transpose(0, 1)
            qs = q[p.row : p.row + p.qlen].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs.unsqueeze(0),
                keys.unsqueeze(0),
                vals.unsqueeze(0),
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[p.row : p.row + p.qlen] = o[0].transpose(0, 1)
        return out

    def _decode(self, q, k_cache, v_cache, heads, dim) -> torch.Tensor:
        n = q.shape[0]
        keys = k_cache.index_select(0, self._dec_table).view(n, -1, heads, dim).transpose(1, 2)
        vals = v_cache.index_select(0, self._dec_table).view(n, -1, heads, v_cache.shape[3]).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, vals, attn_mask=self._dec_mask, scale=self.scale, enable_gqa=True
        )
        return o.squeeze(2)


    def _short(self, q, k_cache, v_cache, heads, dim) -> torch.Tensor:
        """The decode batch with several query tokens per row (``_plan_short``): the real rows' outputs."""
        n, qmax = self._num_decode, self._qmax
        dv = v_cache.shape[3]
        qs = q.index_select(0, self._short_gather).view(n, qmax, q.shape[1], dim).transpose(1, 2)
        keys = k_cache.index_select(0, self._dec_table).view(n, -1, heads, dim).transpose(1, 2)
        vals = v_cache.index_select(0, self._dec_table).view(n, -1, heads, dv).transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=self._dec_mask, scale=self.scale,
                                           enable_gqa=True)
        return o.transpose(1, 2).reshape(n * qmax, q.shape[1], dv).index_select(0, self._short_keep)


@register("torch")
def _make(kv: KVCache, scale: float) -> TorchPagedAttention:
    return TorchPagedAttention(kv, scale)
