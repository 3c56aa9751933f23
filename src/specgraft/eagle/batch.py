"""EAGLE-3 head passes of many requests in ONE forward (issue 27: drafting batched across requests).

Each request's drafter hands out :class:`HeadCall` units (``core.drafter.Work``): its new pairs' features,
tokens, positions, its own head KV cache and visibility mask. :meth:`HeadRunner.run` stacks every unit's rows
(ragged: each request has its own count) through the head's linear layers once -- ``fc``, q/k/v, ``o_proj``, the
MLP and the draft ``lm_head``, where the time goes -- and runs each unit's attention against its own cache::

    rows      [T_1 | T_2 | ... | T_B]           one matrix through fc, qkv, o_proj, mlp, lm_head
    attention unit b: q_b over (past_b, k_b) with bias_b         (each request's cache has its own length)

Units of similar shape (a batch's tree levels) attend in one padded call, masked so that padding gets no weight;
a unit that would multiply the padding (a new request's prompt) attends alone.

A unit alone (B = 1) is the same code, so a request drafts the same tree alone or batched, up to float
rounding of a different matrix shape; verification keeps the output lossless either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .head import Eagle3Head, causal_bias


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

    @property
    def weight(self) -> int:
        """Its share of a batched run's time (``core.drafter.drive_all``, ``forward_s``): its rows."""
        return self.tokens.numel()


@dataclass
class HeadResult:
    h: torch.Tensor  # [T, H] head outputs (the features of the rows' children)
    k: torch.Tensor  # [1, nkv, T, d] the new rows' keys, for the request's cache
    v: torch.Tensor
    logp: torch.Tensor | None  # [len(logit_rows), Vd] float32 log-probabilities


class HeadRunner:
    """The one runner of a head: every drafter on the same head object batches with every other."""

    # False: every unit attends alone (scripts/draft_batch_cost.py's --per-unit-attention cells)
    pad_attention = True

    def __init__(self, head: Eagle3Head):
        self.head = head

    @classmethod
    def of(cls, head: Eagle3Head) -> "HeadRunner":
        """Kept on the head itself, so it lives and dies with it."""
        if getattr(head, "_batch_runner", None) is None:
            head._batch_runner = cls(head)
        return head._batch_runner

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
        mixed = self.attend(q, k, v, calls, offsets)
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

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: list[HeadCall],
               offsets: list[int]) -> torch.Tensor:
        """Every unit's attention against its own cache: ``q [1, nh, T, d]``, ``k, v [1, nkv, T, d]`` (all units'
        rows, unit ``i`` at ``offsets[i]:offsets[i + 1]``) -> ``[1, T, nh*d]``. Units of similar shape share one
        padded call (:func:`padded_attention`); the rest (a new request's prompt beside one-row neighbours) attend
        alone."""
        spans = list(zip(offsets, offsets[1:]))
        shapes = [(b - a, 0 if c.past is None else c.past[0].shape[2]) for c, (a, b) in zip(calls, spans)]
        together = pad_group(shapes) if self.pad_attention else []
        parts: list[torch.Tensor | None] = [None] * len(calls)
        if together:
            cuts = [slice(*spans[i]) for i in together]
            units = [(q[:, :, r], k[:, :, r], v[:, :, r], calls[i].past, calls[i].bias) for i, r in zip(together, cuts)]
            for i, part in zip(together, padded_attention(self.head, units)):
                parts[i] = part
        for i, ((a, b), c) in enumerate(zip(spans, calls)):
            if parts[i] is None:
                parts[i] = self.head.attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], c.past, c.bias)[0]
        return torch.cat(parts).unsqueeze(0)


# Units share one padded attention call while its score entries (units x T_max x (S_max + T_max)) stay within
# this factor of their own: past it (a prompt's rows beside one-row neighbours) the padding costs more than the
# calls it saves.
PAD_WASTE = 2.0


def pad_group(shapes: list[tuple[int, int]]) -> list[int]:
    """Units (new rows ``T``, cached ``S``) that attend in one padded call: all of them, less units dropped one at
    a time (each time the one whose absence pads least) until the padding fits ``PAD_WASTE``; empty when fewer
    than two remain."""

    def waste(group: list[int]) -> float:
        t, s = max(shapes[i][0] for i in group), max(shapes[i][1] for i in group)
        own = sum(shapes[i][0] * sum(shapes[i]) for i in group)
        return len(group) * t * (s + t) / own if own else 1.0

    group = list(range(len(shapes)))
    while len(group) > 1:
        if waste(group) <= PAD_WASTE:
            return group
        group = min(([j for j in group if j != i] for i in group), key=waste)
    return []


def padded_attention(head: Eagle3Head, units: list[tuple]) -> list[torch.Tensor]:
    """Attention of several units in one call, as :meth:`Eagle3Head.attend` computes each alone.

    ``units``: ``(q [1, nh, T_i, d], k, v [1, nkv, T_i, d], past (k, v) [1, nkv, S_i, d] or None,
    bias [1, 1, T_i, S_i + T_i] or None)``. Each unit is padded to ``T = max T_i`` query rows and ``S + T`` keys
    (``S = max S_i``): its cache at columns ``0..S_i``, its new keys at ``S..S + T_i``. Every padded column is
    masked, so the softmax gives it exactly zero weight. Padded query rows see column 0 only (a row that sees
    nothing would be NaN) and are dropped. Returns each unit's ``[T_i, nh*d]``.
    """
    attn = head.midlayer.self_attn
    first = units[0][0]
    n, nh, d, nkv = len(units), first.shape[1], first.shape[3], units[0][1].shape[1]
    T = max(u[0].shape[2] for u in units)
    S = max(0 if u[3] is None else u[3][0].shape[2] for u in units)
    Q = first.new_zeros(n, nh, T, d)
    K, V = first.new_zeros(n, nkv, S + T, d), first.new_zeros(n, nkv, S + T, d)
    bias = torch.full((n, 1, T, S + T), float("-inf"), dtype=first.dtype, device=first.device)
    for j, (q, k, v, past, own) in enumerate(units):
        t, s = q.shape[2], 0 if past is None else past[0].shape[2]
        Q[j, :, :t], K[j, :, S:S + t], V[j, :, S:S + t] = q[0], k[0], v[0]
        if past is not None:
            K[j, :, :s], V[j, :, :s] = past[0][0], past[1][0]
        own = causal_bias(t, s, first) if own is None else own[0, 0]
        bias[j, 0, :t, :s], bias[j, 0, :t, S:S + t] = own[:, :s], own[:, s:]
        bias[j, 0, t:, 0] = 0
    p = torch.softmax((attn.scores(Q, K) + bias).float(), -1).to(first.dtype)
    mixed = attn.weighted(p, V)  # [n, T, nh*d]
    return [mixed[j, :u[0].shape[2]] for j, u in enumerate(units)]
