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
        # Attention per unit, against its own cache: padding every unit to the longest would cost B * T_max *
        # (S_max + T_max) (a new request's whole prompt beside one-row neighbours), and measured no faster.
        mixed = torch.cat([head.attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], c.past, c.bias)
                           for c, a, b in zip(calls, offsets, offsets[1:])], 1)
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

