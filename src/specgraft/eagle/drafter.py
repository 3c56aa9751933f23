"""EAGLE-3 dynamic-tree drafter: the head drafts a tree by beam expansion + global rerank (EAGLE-2/3).

Each step, in the head's own KV cache (positions = pair positions, see :mod:`specgraft.eagle.head`)::

    committed:  pairs (f_t, x_{t+1}) for t < N-1        (target features of accepted tokens, fused by fc)
    extend:     the new pairs since the last step       -> h_last; level 0 = topk(lm_head(norm(h_last)))
    expand x depth: frontier nodes (k of them), feature = the parent's head output, position = N-2+depth,
                each attends to the committed pairs and its speculative ancestors
    rerank:     best ``budget`` of k + depth*k^2 candidates by cumulative log-prob  -> tree

The speculative keys are dropped after drafting; ``observe`` takes the target's hidden states at the
accepted nodes (root first) as the features of the next extend. Candidates are deterministic, so trees are
verified with the q = 1 rule at any temperature.

In our words, with the worked examples the tests assert: docs/design.md §4.5.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from ..core.drafter import DraftContext, ProposeSteps, drive
from ..core.tree import Tree, path_to
from ..drafters.dynamic_tree import Candidates, Gate, Pool, candidates_tree, expand_topk_steps
from .batch import HeadCall, HeadRunner
from .head import Eagle3Head

# A step with budget 0 (the scheduler's policy under load) drafts nothing, so the head does not run at all:
# the accepted tokens' features wait and are fed in one pass the next time the request drafts. Up to this many
# rows wait; beyond, they are fed anyway (the head's cache must not fall arbitrarily far behind).
DEFER_MAX = 64


class EagleDrafter:
    name = "eagle"
    shape = "tree"
    needs_prefill_logits = False
    # False: expand every level to top_k even where the tree cannot keep it (before issue 27's cap; kept to
    # measure the difference, scripts/draft_batch_cost.py --full-frontier)
    cap_frontier = True

    def __init__(self, head: Eagle3Head, label: str = "custom", top_k: int = 10, depth: int = 7):
        if not (isinstance(top_k, int) and 1 <= top_k <= head.config.draft_vocab_size
                and isinstance(depth, int) and depth >= 0):
            raise ValueError(f"eagle needs integer 1 <= top_k <= {head.config.draft_vocab_size} and depth >= 0")
        self.head, self.label, self.top_k, self.depth = head, label, top_k, depth
        self.runner = HeadRunner.of(head)  # shared by every drafter on this head: their passes batch together
        self.hidden_layers = tuple(head.config.target_layers)
        # KV buffers [1, nkv, capacity, d] written by position: committed pairs first, then this step's
        # speculative nodes (overwritten next step); views of them are the head's cache.
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.n = 0  # committed pairs
        self.pending: torch.Tensor | None = None  # [m, 3H] target features not yet fed
        self.forward_s = 0.0

    def fork(self) -> "EagleDrafter":
        c = copy.copy(self)  # shares the head; the KV buffers and features are per request
        c.kbuf = c.vbuf = c.pending = None
        c.n, c.forward_s = 0, 0.0
        return c

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        self.n = 0
        self.pending = self._features(prefill_hidden, slice(None))

    def _features(self, hidden: dict[int, torch.Tensor], rows) -> torch.Tensor:
        # in the head's dtype: llama.cpp hands fp32 features to a bf16 head
        return torch.cat([hidden[i][rows] for i in self.hidden_layers], -1).to(self.head.dtype)

    def _write(self, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        need = at + k.shape[2]
        if self.kbuf is None or self.kbuf.shape[2] < need:  # grow geometrically: amortised O(1) per pair
            cap = max(256, 2 * need)
            kb, vb = k.new_empty(*k.shape[:2], cap, k.shape[3]), v.new_empty(*v.shape[:2], cap, v.shape[3])
            if self.kbuf is not None:
                kb[:, :, :at], vb[:, :, :at] = self.kbuf[:, :, :at], self.vbuf[:, :, :at]
            self.kbuf, self.vbuf = kb, vb
        self.kbuf[:, :, at:need], self.vbuf[:, :, at:need] = k, v

    def _past(self, length: int):
        return None if length == 0 else (self.kbuf[:, :, :length], self.vbuf[:, :, :length])

    def propose(self, ctx: DraftContext) -> Tree:
        return drive(self.propose_steps(ctx))

    def propose_steps(self, ctx: DraftContext) -> ProposeSteps:
        """The proposal as head passes handed out one at a time (``core.drafter.drive_all`` batches them
        across requests)."""
        # the tree keeps the best ``budget`` candidates: expand only what can be among them
        keep = ctx.budget if self.cap_frontier else None
        return candidates_tree(ctx, (yield from self.draft_steps(ctx, keep=keep)), ctx.budget)

    def draft(self, ctx: DraftContext, gate: Gate | None = None) -> Candidates | None:
        """Feed the pending features, then expand to full width (``gate`` may stop early); candidates hold
        target ids."""
        return drive(self.draft_steps(ctx, gate))

    def _call(self, feat, fuse, tokens, positions, past, bias, logit_rows) -> HeadCall:
        return HeadCall(self.runner, self, feat, fuse, tokens, positions, past, bias, logit_rows)

    def draft_steps(self, ctx: DraftContext, gate: Gate | None = None, keep: int | None = None):
        """:meth:`draft` as steps: yields :class:`HeadCall` units, is sent their results. ``keep``: only the best
        ``keep`` candidates will be used (``expand_topk_steps`` caps the frontiers)."""
        if ctx.budget <= 0 and self.pending.shape[0] < DEFER_MAX:
            return None  # nothing to draft: the features wait and join the next extend (see DEFER_MAX)
        head, n = self.head, self.n
        new_tokens = torch.tensor(ctx.ids[n + 1 :])
        if new_tokens.numel() != self.pending.shape[0]:
            raise AssertionError(f"eagle: {self.pending.shape[0]} features for {new_tokens.numel()} new tokens")
        pos = torch.arange(n, n + new_tokens.numel())
        want = slice(-1, None) if ctx.budget > 0 else None
        res = yield self._call(self.pending, True, new_tokens, pos, self._past(n), None, want)
        self._write(n, res.k, res.v)
        self.n = n + new_tokens.numel()
        self.pending = None
        if ctx.budget <= 0:
            return None
        h_last, base = res.h[-1], self.n  # base = N - 1: the position of level-0 nodes
        outs: dict[int, torch.Tensor] = {}  # candidate -> its head output (the feature of its children)
        slot: dict[int, int] = {}  # candidate -> index among the speculative keys
        pool = Pool()  # the candidates (draft-vocabulary ids), filled by expand_topk_steps

        def expand_call(frontier: list[int]) -> HeadCall:
            feats, depth = [], []
            A, f = len(slot), len(frontier)
            bias = torch.zeros(1, 1, f, base + A + f, dtype=res.h.dtype)
            hidden = torch.full((f, A + f), True)
            for j, c in enumerate(frontier):
                par = pool.parents[c]
                feats.append(h_last if par == -1 else outs[par])
                path = path_to(pool.parents, c)  # c's speculative ancestors, then c itself
                hidden[j, A + j] = False
                hidden[j, [slot[a] for a in path[:-1]]] = False
                depth.append(len(path))
            bias[0, 0, :, base:].masked_fill_(hidden, float("-inf"))
            toks = head.to_target(torch.tensor([pool.tokens[c] for c in frontier]))
            return self._call(torch.stack(feats), False, toks, torch.tensor(depth) + base - 1, self._past(base + A),
                              bias, slice(None))

        steps = expand_topk_steps(res.logp[0], self.top_k, self.depth, gate, keep, pool)
        logp = None
        while True:
            try:
                frontier = steps.send(logp)
            except StopIteration as stop:
                cands = stop.value
                break
            out = yield expand_call(frontier)
            A = len(slot)
            self._write(base + A, out.k, out.v)
            for j, c in enumerate(frontier):
                slot[c], outs[c] = A + j, out.h[j]
            logp = out.logp
        # expand_topk saw draft-vocabulary ids; the tree holds target ids.
        return replace(cands, tokens=head.to_target(torch.tensor(cands.tokens)).tolist())

    def observe(self, tree, logits, verdict, hidden=None) -> None:
        feats = self._features(hidden, torch.tensor(verdict.accepted))
        # features of a step that drafted nothing are still pending: they are fed together next time
        self.pending = feats if self.pending is None else torch.cat([self.pending, feats])

    def describe(self) -> dict:
        c = self.head.config
        return {"method": self.name, "head": self.label, "top_k": self.top_k, "depth": self.depth,
                "draft_vocab": c.draft_vocab_size, "head_intermediate": c.intermediate_size}
