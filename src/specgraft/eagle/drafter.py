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
import time
from dataclasses import replace

import torch

from ..drafters.dynamic_tree import Candidates, Gate, candidates_tree, expand_topk
from .head import Eagle3Head
from ..core.tree import Tree, path_to
from ..core.drafter import DraftContext


class EagleDrafter:
    name = "eagle"
    shape = "tree"
    needs_prefill_logits = False

    def __init__(self, head: Eagle3Head, label: str = "custom", top_k: int = 10, depth: int = 7):
        if not (isinstance(top_k, int) and 1 <= top_k <= head.config.draft_vocab_size
                and isinstance(depth, int) and depth >= 0):
            raise ValueError(f"eagle needs integer 1 <= top_k <= {head.config.draft_vocab_size} and depth >= 0")
        self.head, self.label, self.top_k, self.depth = head, label, top_k, depth
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

    def _timed(self, fn, *args):
        """Run a head forward (fc, decoder layer, lm_head), timing it as the drafter's model time."""
        t0 = time.perf_counter()
        out = fn(*args)
        self.forward_s += time.perf_counter() - t0
        return out

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        self.n = 0
        self.pending = self._features(prefill_hidden, slice(None))

    def _features(self, hidden: dict[int, torch.Tensor], rows) -> torch.Tensor:
        # in the head's dtype: llama.cpp hands fp32 features to a bf16 head
        return torch.cat([hidden[i][rows] for i in self.hidden_layers], -1).to(self.head.fc.weight.dtype)

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
        return candidates_tree(ctx, self.draft(ctx), ctx.budget)

    @torch.inference_mode()
    def draft(self, ctx: DraftContext, gate: Gate | None = None) -> Candidates | None:
        """Feed the pending features, then expand (``gate`` may stop early); candidates hold target ids."""
        head, n = self.head, self.n
        new_tokens = torch.tensor(ctx.ids[n + 1 :])
        if new_tokens.numel() != self.pending.shape[0]:
            raise AssertionError(f"eagle: {self.pending.shape[0]} features for {new_tokens.numel()} new tokens")
        pos = torch.arange(n, n + new_tokens.numel())
        h, (k, v) = self._timed(head.step, self._timed(head.fc, self.pending).unsqueeze(0), new_tokens.unsqueeze(0), pos.unsqueeze(0),
                              self._past(n), None)
        self._write(n, k, v)
        self.n = n + new_tokens.numel()
        self.pending = None
        if ctx.budget <= 0:
            return None
        h_last, base = h[0, -1], self.n  # base = N - 1: the position of level-0 nodes
        outs: dict[int, torch.Tensor] = {}  # candidate -> its head output (the feature of its children)
        slot: dict[int, int] = {}  # candidate -> index among the speculative keys
        cand_tokens: list[int] = []  # target ids, mirrored from expand_topk's candidate list
        cand_parents: list[int] = []

        def children(logp: torch.Tensor, parents: list[int]) -> None:
            top = head.to_target(torch.topk(logp, self.top_k, dim=-1).indices)
            for row, par in enumerate(parents):
                cand_tokens.extend(top[row].tolist())
                cand_parents.extend([par] * self.top_k)

        def expand(frontier: list[int]) -> torch.Tensor:
            feats, depth = [], []
            A, f = len(slot), len(frontier)
            bias = torch.zeros(1, 1, f, base + A + f, dtype=h.dtype)
            hidden = torch.full((f, A + f), True)
            for j, c in enumerate(frontier):
                par = cand_parents[c]
                feats.append(h_last if par == -1 else outs[par])
                path = path_to(cand_parents, c)  # c's speculative ancestors, then c itself
                hidden[j, A + j] = False
                hidden[j, [slot[a] for a in path[:-1]]] = False
                depth.append(len(path))
            bias[0, 0, :, base:].masked_fill_(hidden, float("-inf"))
            toks = torch.tensor([cand_tokens[c] for c in frontier])
            out, (k2, v2) = self._timed(head.step, torch.stack(feats).unsqueeze(0), toks.unsqueeze(0),
                                      (torch.tensor(depth) + base - 1).unsqueeze(0), self._past(base + A), bias)
            self._write(base + A, k2, v2)
            for j, c in enumerate(frontier):
                slot[c], outs[c] = A + j, out[0, j]
            logp = torch.log_softmax(self._timed(head.logits, out[0]).float(), -1)
            children(logp, frontier)
            return logp

        first = torch.log_softmax(self._timed(head.logits, h_last).float(), -1)
        children(first.unsqueeze(0), [-1])
        cands = expand_topk(first, expand, self.top_k, self.depth, gate)
        # expand_topk saw draft-vocabulary ids; the tree holds target ids.
        return replace(cands, tokens=cand_tokens[: len(cands.tokens)])

    def observe(self, tree, logits, verdict, hidden=None) -> None:
        self.pending = self._features(hidden, torch.tensor(verdict.accepted))

    def describe(self) -> dict:
        c = self.head.config
        return {"method": self.name, "head": self.label, "top_k": self.top_k, "depth": self.depth,
                "draft_vocab": c.draft_vocab_size, "head_intermediate": c.intermediate_size}
