"""EAGLE-3 head passes of many requests in ONE forward (issue 27: drafting batched across requests).

Each request's drafter hands out :class:`HeadCall` units (``core.drafter.Work``): its new pairs' features,
tokens, positions, its own head KV cache and visibility mask. :meth:`HeadRunner.run` stacks every unit's rows
(ragged: each request has its own count) through the head's linear layers once -- ``fc``, q/k/v, ``o_proj``, the
MLP and the draft ``lm_head``, where the time goes -- and runs attention per unit against that unit's own cache::

    rows      [T_1 | T_2 | ... | T_B]           one matrix through fc, qkv, o_proj, mlp, lm_head
    attention unit b: q_b over (past_b, k_b) with bias_b         (each request's cache has its own length)

A unit alone (B = 1) is the same code, so a request drafts the same tree alone or batched, up to float
rounding of a different matrix shape; verification keeps the output lossless either way.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from .head import Eagle3Head


@dataclass
class HeadCall:
    """One request's head pass: ``feat [T, 3H]`` target features (``fuse``: through ``fc`` first) or
    ``[T, H]`` head outputs of the parents; ``tokens, positions [T]``; ``past`` its keys/values
    ``[1, nkv, S, d]``; ``bias [1, 1, T, S + T]`` (None: causal over the new rows, all of ``past`` visible);
    ``logit_rows``: the rows whose draft log-probabilities come back (None: none)."""

    runner: "HeadRunner"
    owner: object  # the drafter credited with its share of the head time (its ``forward_s``)
    feat: torch.Tensor
    fuse: bool
    tokens: torch.Tensor
    positions: torch.Tensor
    past: tuple[torch.Tensor, torch.Tensor] | None
    bias: torch.Tensor | None
    logit_rows: slice | None


@dataclass
class HeadResult:
    h: torch.Tensor  # [T, H] head outputs (the features of the rows' children)
    k: torch.Tensor  # [1, nkv, T, d] the new rows' keys, for the request's cache
    v: torch.Tensor
    logp: torch.Tensor | None  # [len(logit_rows), Vd] float32 log-probabilities


class HeadRunner:
    """The one runner of a head: every drafter on the same head object batches with every other."""

    _of: "weakref.WeakKeyDictionary[Eagle3Head, HeadRunner]" = weakref.WeakKeyDictionary()

    def __init__(self, head: Eagle3Head):
        self.head = head

    @classmethod
    def of(cls, head: Eagle3Head) -> "HeadRunner":
        if head not in cls._of:
            cls._of[head] = cls(head)
        return cls._of[head]

    @torch.inference_mode()
    def run(self, calls: list[HeadCall]) -> list[HeadResult]:
        start = time.perf_counter()
        head = self.head
        attn = head.midlayer.self_attn
        sizes = [c.tokens.numel() for c in calls]
        feats = [c.feat for c in calls]
        fused = [i for i, c in enumerate(calls) if c.fuse]
        if fused:  # one fc over every unit's target features
            parts = head.fc(torch.cat([calls[i].feat for i in fused])).split([sizes[i] for i in fused])
            for i, part in zip(fused, parts):
                feats[i] = part
        feat = torch.cat(feats).unsqueeze(0)  # [1, T, H]
        x = head.midlayer.inputs(feat, head.embed_tokens(torch.cat([c.tokens for c in calls])).unsqueeze(0))
        q, k, v = attn.qkv(x, torch.cat([c.positions for c in calls]).unsqueeze(0))
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        if len(calls) == 1:
            mixed = head.attend(q, k, v, calls[0].past, calls[0].bias)
        else:
            mixed = padded_attention(head, calls, q, k, v, offsets)
        h = head.midlayer.finish(feat, attn.o_proj(mixed))[0]  # [T, H]
        per_call = [h[a:b] for a, b in zip(offsets, offsets[1:])]
        wanted = [i for i, c in enumerate(calls) if c.logit_rows is not None]
        logp: dict[int, torch.Tensor] = {}
        if wanted:  # one draft lm_head over every unit's wanted rows
            picked = [per_call[i][calls[i].logit_rows] for i in wanted]
            rows = torch.log_softmax(head.logits(torch.cat(picked)).float(), -1).split([len(p) for p in picked])
            logp = dict(zip(wanted, rows))
        out = [HeadResult(per_call[i], k[:, :, a:b], v[:, :, a:b], logp.get(i))
               for i, (a, b) in enumerate(zip(offsets, offsets[1:]))]
        elapsed, total = time.perf_counter() - start, sum(sizes)
        for c, n in zip(calls, sizes):  # each drafter's model time: its share of the rows
            c.owner.forward_s += elapsed * n / total
        return out


def padded_attention(head: Eagle3Head, calls: list[HeadCall], q, k, v, offsets: list[int]) -> torch.Tensor:
    """Every unit's attention in one batched product: unit b's queries (padded to the longest unit) over its
    own cache and new keys (padded to the longest cache), padding masked out. Returns ``[1, T, nh*d]``, the
    units' rows in order (as ``head.attend`` per unit would, up to float rounding)."""
    attn = head.midlayer.self_attn
    B, nkv, d = len(calls), k.shape[1], k.shape[3]
    lens = [b - a for a, b in zip(offsets, offsets[1:])]
    pasts = [0 if c.past is None else c.past[0].shape[2] for c in calls]
    T, S = max(lens), max(pasts)
    keys = k.new_zeros(B, nkv, S + T, d)
    values = v.new_zeros(B, nkv, S + T, d)
    queries = q.new_zeros(B, q.shape[1], T, d)
    bias = torch.full((B, 1, T, S + T), float("-inf"), dtype=q.dtype)
    bias[:, 0, :, 0] = 0  # padding rows see one (zero) key: finite, and discarded below
    for b, (c, n, s, at) in enumerate(zip(calls, lens, pasts, offsets)):
        queries[b, :, :n] = q[0, :, at: at + n]
        keys[b, :, S: S + n], values[b, :, S: S + n] = k[0, :, at: at + n], v[0, :, at: at + n]
        if s:
            keys[b, :, :s], values[b, :, :s] = c.past[0][0], c.past[1][0]
        if c.bias is not None:
            own = c.bias.reshape(n, s + n)
        else:  # causal over the new rows, the whole cache visible
            own = torch.zeros(n, s + n, dtype=q.dtype)
            own[:, s:] = torch.full((n, n), float("-inf"), dtype=q.dtype).triu(1)
        bias[b, 0, :n, :s] = own[:, :s]
        bias[b, 0, :n, S: S + n] = own[:, s:]
        if s == 0 and S > 0:
            bias[b, 0, :n, 0] = float("-inf")  # column 0 is padding for a unit without a cache
    p = torch.softmax((attn.scores(queries, keys) + bias).float(), -1).to(q.dtype)
    out = attn.weighted(p, values)  # [B, T, nh*d]
    return torch.cat([out[b, :n] for b, n in enumerate(lens)]).unsqueeze(0)
