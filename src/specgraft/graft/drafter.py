"""Graft and the pruning baselines, on top of any tree drafter (EAGLE-3 head, draft-model tree or chain).

One step (``variant="graft"``)::

    inner.draft(gate)            expand level by level; the gate (checkpoints 0/1/5) may stop it -> stage s
    rerank(K_draft[s])           keep the best draft candidates (prefix-closed)
    graft_merge(template[s])     fill the freed K_max - K_draft[s] slots from the adjacency matrix, same root
    -> one verification          the loop's lossless rule; retrieved nodes are ordinary candidates
    observe                      M[x_i] = topk(p_i) for every verified node, then the inner drafter's observe

With ``context`` on (the default), the freed slots are shared with a second retrieval source: continuations
of earlier occurrences of the sequence's suffix (:mod:`.context`), ranked against the template's nodes by
calibrated acceptance estimates; for Graft-TAIL a context continuation may be the tail. ``context=False``
is the paper's Graft.

Variants (the paper's ablations): ``prune`` (the gate, freed slots stay empty; with policy echo/ddd/svip),
``fixed`` (no gate, stage-1 split every step), ``root`` (no gate, 1/3 of the budget to a root template),
``batch`` (draft to full depth, stage from the recorded confidences: fixed tree shapes), and for
chain drafters ``tail`` (keep the confident prefix, fill the rest of the chain with M's rank-0 chain).
All candidates are deterministic given the state before verification, so every variant is lossless.

In our words, with the worked examples the tests assert: docs/design.md §5.1, §5.5.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from dataclasses import replace

import numpy as np
import torch

from ..drafters.dynamic_tree import InnerDrafter, draft_steps_of, rerank
from .context import ContextModel, context_trie, find_matches, request_factor, split_slots, take_trie
from .templates import RANK_WEIGHTS, ROOT_SHARE, graft_merge, path_weight, stage_split, stage_template, sweep_template
from .pruning import SparseGate
from ..core.tree import SOURCE_CONTEXT, SOURCE_DRAFT, SOURCE_RETRIEVAL, SOURCE_ROOT, Tree
from ..core.drafter import DraftContext, ProposeSteps, drive, release
from ..drafters.matrix import AdjacencyMatrix

TREE_VARIANTS = ("graft", "prune", "fixed", "root", "batch")
CHAIN_VARIANTS = ("tail", "prune")


class GraftDrafter:
    needs_prefill_logits = True  # the prefill's logits write the prompt tokens' rows (free observations)
    # This step's budget was 0 (the scheduler's, under load): its verified root does not update the matrix, a
    # top-k over the vocabulary (~0.27 ms a request on Qwen's 151,936) the batch waits for every step.
    _idle = False

    def __init__(self, inner: InnerDrafter, vocab_size: int, variant: str = "graft", policy=None, k: int = 8,
                 scope: str = "request", snapshot: dict | None = None, dedup: str = "merge",
                 tau_tail: float = 0.1, rank_weights: tuple[float, ...] | None = None, name: str = "graft",
                 calibration: str = "fallback", sweep: tuple[int, int] | None = None,
                 matrix_source: str = "calibration", calibration_info: dict | None = None,
                 context: bool = True, context_model: ContextModel | None = None, ctx_ngram: int = 3,
                 ctx_chains: int = 4, head_expected: list[float] | None = None):
        chain = inner.shape == "chain"
        variant = "tail" if chain and variant == "graft" else variant  # Graft on a chain is Graft-TAIL
        allowed = CHAIN_VARIANTS if chain else TREE_VARIANTS
        if variant not in allowed:
            raise ValueError(f"variant '{variant}' is not available for a {'chain' if chain else 'tree'} drafter; "
                             f"choose one of: {', '.join(allowed)}")
        if scope not in ("request", "global"):
            raise ValueError(f"scope must be 'request' or 'global', got {scope!r}")
        if dedup == "none":
            # A duplicate sibling is never entered (the walk takes the first match), so its retrieved subtree
            # would only waste slots; choosing among duplicates by their subtrees would be lossy under sampling.
            raise ValueError("dedup='none' is refused: duplicate siblings are unreachable by the verification walk; "
                             "use 'merge' or 'skip'")
        if dedup not in ("merge", "skip"):
            raise ValueError(f"dedup must be 'merge' or 'skip', got {dedup!r}")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"graft k must be an integer >= 1, got {k!r}")
        if not 0 < tau_tail <= 1:
            raise ValueError(f"tau_tail must be in (0, 1], got {tau_tail}")
        for key, val in (("ctx_ngram", ctx_ngram), ("ctx_chains", ctx_chains)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"graft {key} must be an integer >= 1, got {val!r}")
        self.inner, self.chain, self.variant, self.name = inner, chain, variant, name
        self.policy = policy if policy is not None else SparseGate()
        self.hidden_layers = tuple(inner.hidden_layers)
        self.matrix = AdjacencyMatrix(vocab_size, k)
        self.scope, self.snapshot, self.dedup, self.tau_tail = scope, snapshot, dedup, tau_tail
        self.rank_weights = tuple(rank_weights) if rank_weights else None
        self.calibration, self.sweep, self.matrix_source = calibration, sweep, matrix_source
        self.calibration_info = calibration_info
        self.context = bool(context) and variant != "prune"  # pruning baselines retrieve nothing
        self.ctx_model = context_model or ContextModel.prior()
        self.ctx_ngram, self.ctx_chains = ctx_ngram, ctx_chains
        # [K] = the head's expected accepted tokens per step at budget K (calibration; None: never skip the head)
        self.head_expected = head_expected
        # This request's context record (request_factor): context tokens accepted, and the sum of the estimates
        # of the context nodes offered.
        self._ctx = {"accepted": 0.0, "expected": 0.0}
        self._templates: dict[tuple, tuple] = {}
        self.lifetime_retrieval = self.lifetime_context = self.lifetime_context_first = 0
        # With scope "global", forks share the matrix and this request counter (the matrix is set up once).
        self.shared = {"requests": 0}
        self.counters: Counter = Counter()
        self.stages: Counter = Counter()
        self.times = Counter()
        if snapshot is not None:
            self.matrix.load_snapshot(snapshot)

    # -- the drafter protocol ---------------------------------------------------------------------------
    @property
    def forward_s(self) -> float:
        return self.inner.forward_s

    @property
    def requests(self) -> int:
        return self.shared["requests"]

    def fork(self) -> "GraftDrafter":
        c = copy.copy(self)  # settings, policy and templates are shared; the state below is per request
        c.inner = self.inner.fork()
        if self.scope == "request":
            c.matrix, c.shared = AdjacencyMatrix(self.matrix.table.shape[0], self.matrix.k), {"requests": 0}
        c.counters, c.stages, c.times = Counter(), Counter(), Counter()
        c.lifetime_retrieval = c.lifetime_context = c.lifetime_context_first = 0
        c._ctx = {"accepted": 0.0, "expected": 0.0}
        return c

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        inner_logits = prefill_logits if self.inner.needs_prefill_logits else None
        self.inner.start(prompt_ids, inner_logits, prefill_hidden)
        if self.scope == "request" or self.requests == 0:
            if self.snapshot is not None:
                self.matrix.load_snapshot(self.snapshot)
            else:
                self.matrix.clear()
        self.shared["requests"] += 1
        self.counters, self.stages, self.times = Counter(), Counter(), Counter()  # per request (records)
        self._ctx = {"accepted": 0.0, "expected": 0.0}
        if prefill_logits is not None:
            self.matrix.update_prompt(prompt_ids, prefill_logits)

    def propose(self, ctx: DraftContext) -> Tree:
        return drive(self.propose_steps(ctx))

    def propose_steps(self, ctx: DraftContext) -> ProposeSteps:
        """The proposal as the inner drafter's passes (batched across requests where it batches: the EAGLE
        head); the retrieval sources are host work between them. ``times.propose_s`` is wall time, batched
        passes included."""
        t0 = time.perf_counter()
        self._idle = ctx.budget <= 0
        tree = (yield from self._propose_chain(ctx)) if self.chain else (yield from self._propose_tree(ctx))
        self.times["propose_s"] += time.perf_counter() - t0
        src = tree.source
        self.counters["offered_draft"] += int((src == SOURCE_DRAFT).sum())
        self.counters["offered_retrieval"] += int((src == SOURCE_RETRIEVAL).sum())
        self.counters["offered_context"] += int((src == SOURCE_CONTEXT).sum())
        self.lifetime_retrieval += int((src == SOURCE_RETRIEVAL).sum())  # across requests (tests)
        self.lifetime_context += int((src == SOURCE_CONTEXT).sum())
        return tree

    def release(self) -> None:
        release(self.inner)  # a draft model's row of its shared cache

    def observe(self, tree: Tree, logits: torch.Tensor, verdict, hidden=None) -> None:
        acc = tree.source[torch.tensor(verdict.accepted[1:], dtype=torch.long)]
        self.counters["accepted_draft"] += int((acc == SOURCE_DRAFT).sum())
        self.counters["accepted_retrieval"] += int((acc == SOURCE_RETRIEVAL).sum())
        n_ctx = int((acc == SOURCE_CONTEXT).sum())
        self.counters["accepted_context"] += n_ctx
        self._ctx["accepted"] += n_ctx
        if not self._idle:
            self.matrix.update(tree.tokens, logits)  # every verified node, accepted or not, draft or retrieved
        self.inner.observe(tree, logits, verdict, hidden)

    def describe(self) -> dict:
        inner = self.inner.describe()
        c = self.counters
        offered = c["offered_retrieval"]
        return {"method": self.name, "variant": self.variant, "drafter": inner,
                "policy": getattr(self.policy, "name", type(self.policy).__name__),
                "thresholds": list(getattr(self.policy, "thresholds", ())) or None,
                "calibration": self.calibration, "calibration_info": self.calibration_info,
                "tau_tail": self.tau_tail if self.chain else None,
                "k": self.matrix.k, "scope": self.scope, "dedup": self.dedup, "template_sweep": self.sweep,
                "matrix_source": self.matrix_source,
                "retrieval_state": "warm" if self.snapshot is not None else
                ("cold" if self.scope == "request" or self.requests <= 1 else "hot"),
                "rows_filled": self.matrix.rows_filled, "populated_bytes": self.matrix.populated_bytes,
                "stage_histogram": {str(k): v for k, v in sorted(self.stages.items(), key=str)},
                "context": {"on": self.context, "model": self.ctx_model.source, "ngram": self.ctx_ngram,
                            "chains": self.ctx_chains} if self.context else None,
                "counters": dict(c), "retrieval_hit_rate": c["accepted_retrieval"] / offered if offered else None,
                "context_hit_rate": c["accepted_context"] / c["offered_context"] if c["offered_context"] else None,
                "times": {k: round(v, 4) for k, v in self.times.items()}}

    # -- trees -----------------------------------------------------------------------------------------------
    def _retrieval(self, key: tuple, stage: int, slots: int):
        """(template, parents array) for a stage at a slot count, built once."""
        if key not in self._templates:
            weights = self.rank_weights or RANK_WEIGHTS
            tpl = sweep_template(slots, *self.sweep, weights, self.matrix.k) if self.sweep else \
                stage_template(stage, slots, weights, self.matrix.k)
            parents, ranks, depths = tpl.arrays
            values = [path_weight(p, weights) for p in tpl.paths[: tpl.n_template]]  # prior P(path accepted)
            self._templates[key] = (tpl, parents, ranks, depths, values)
        return self._templates[key]

    def _split(self, ctx: DraftContext, cands) -> tuple[int, int | None, int]:
        """(draft nodes kept, template stage or None, retrieval slots) for this step's variant."""
        budget = ctx.budget
        split = stage_split(budget)
        if self.variant in ("graft", "prune"):
            stage = self.policy.stage_of(cands.stopped_at) if isinstance(self.policy, SparseGate) else None
            if isinstance(self.policy, SparseGate) or cands.stopped_at is None:
                self.stages["none" if stage is None else stage] += 1
            else:
                self.stages[f"level{cands.stopped_at}"] += 1
            n_draft = budget if stage is None else split[stage]
            return n_draft, (None if self.variant == "prune" else stage), budget - n_draft
        if self.variant == "batch":
            stage = self.policy.stage_from_confidences(cands.level_best)
            self.stages["none" if stage is None else stage] += 1
            n_draft = budget if stage is None else split[stage]
            return n_draft, stage, budget - n_draft
        if self.variant == "fixed":
            self.stages[1] += 1
            return split[1], 1, budget - split[1]
        ret = min(budget, max(1, round(ROOT_SHARE * budget)))  # root
        self.stages["root"] += 1
        return budget - ret, 2, ret

    def _propose_tree(self, ctx: DraftContext) -> ProposeSteps:
        gate = self.policy if self.variant in ("graft", "prune") else None
        root = ctx.ids[-1]
        matches = find_matches(ctx.ids, self.ctx_ngram, self.ctx_chains) if self.context and ctx.budget > 0 else []
        if matches and self._context_first(matches, ctx.budget):
            # The best context chain alone is expected to be accepted at least as far as the head's whole tree
            # (calibrated): skip the expansion (the inner drafter only takes in the accepted tokens) and give
            # every slot to the retrieval sources, in the root-collapse (stage 0) shape.
            yield from draft_steps_of(self.inner, replace(ctx, budget=0), None)
            self.stages["context"] += 1
            self.lifetime_context_first += 1
            return self._graft(ctx, [root], [-1], [SOURCE_ROOT], 0, ctx.budget, matches)
        cands = yield from draft_steps_of(self.inner, ctx, gate)
        if cands is None:
            return Tree.chain(root, [])
        n_draft, stage, slots = self._split(ctx, cands)
        tokens, parents, _ = rerank(cands, n_draft)
        tokens, parents = [root, *tokens], [-1, *parents]
        source = [SOURCE_ROOT] + [SOURCE_DRAFT] * (len(tokens) - 1)
        if stage is None or slots <= 0:
            return Tree.build(tokens, parents, source)
        return self._graft(ctx, tokens, parents, source, stage, slots, matches)

    def _context_first(self, matches, budget: int) -> bool:
        """Does the best chain's expected accepted length (the sum of its estimates within the budget) reach the
        head's (the calibration's dense tree at this budget)? Never without a calibration."""
        if self.head_expected is None:
            return False
        head = self.head_expected[min(budget, len(self.head_expected) - 1)]
        return sum(self.ctx_model.values(matches[0], self._factor())[:budget]) >= head

    def _graft(self, ctx, tokens, parents, source, stage: int, slots: int, matches) -> Tree:
        """Fill ``slots`` under the root: the context trie's share first, then the stage's matrix template."""
        t0 = time.perf_counter()
        tpl, tpar, ranks, depths, tvals = self._retrieval((stage, slots), stage, slots)
        got = self.matrix.gather(ctx.ids[-1], tpar, ranks, depths).tolist()
        if matches:
            tokens, parents, source, used = self._graft_context(ctx.ids, tokens, parents, source, got, tvals, slots,
                                                                matches)
            if used:  # the matrix gets what is left, in the template of that size
                slots -= used
                if slots <= 0:
                    self.times["retrieval_s"] += time.perf_counter() - t0
                    return Tree.build(tokens, parents, source)
                tpl, tpar, ranks, depths, _ = self._retrieval((stage, slots), stage, slots)
                got = self.matrix.gather(ctx.ids[-1], tpar, ranks, depths).tolist()
        hyb = graft_merge(tokens, parents, got, tpar, slots, tpl.n_template, self.dedup,
                          row=lambda t: self.matrix.table[t].tolist(), source=source)
        self.counters["dedup"] += hyb.n_dedup
        self.times["retrieval_s"] += time.perf_counter() - t0
        return Tree.build(hyb.tokens, hyb.parents, hyb.source)

    def _factor(self) -> float:
        return request_factor(self._ctx["accepted"], self._ctx["expected"])

    def _graft_context(self, ids, tokens, parents, source, got, tvals, slots, matches):
        """Merge the context trie's share of ``slots`` into the tree: (tokens, parents, source, slots used)."""
        f = self._factor()
        ctok, cpar, cval = context_trie(matches, [self.ctx_model.values(m, f) for m in matches])
        mvals = [v for v, g in zip(tvals, got[1:]) if g >= 0]  # a cold row offers nothing
        n = split_slots(cval, mvals, slots)
        self.counters["context_steps"] += 1
        if n == 0:
            return tokens, parents, source, 0
        keep = take_trie(ctok, cpar, cval, n)
        pos = {node: i + 1 for i, node in enumerate(keep)}
        retrieved = [ids[-1], *(ctok[node - 1] for node in keep)]
        tpar = np.array([-1, *(pos.get(cpar[node - 1], 0) for node in keep)])
        hyb = graft_merge(tokens, parents, retrieved, tpar, n, len(keep) + 1, "merge",
                          source_retrieval=SOURCE_CONTEXT, source=source)
        self._ctx["expected"] += sum(cval[keep[u - 1] - 1] for u in hyb.added_from)  # merged nodes are not offered
        self.counters["dedup_context"] += hyb.n_dedup
        return hyb.tokens, hyb.parents, hyb.source, hyb.n_retrieved

    def _propose_chain(self, ctx: DraftContext) -> ProposeSteps:
        """Graft-TAIL: the draft chain stops below ``tau_tail``; the tail is a context continuation when its
        first token's estimate beats the matrix's rank 0, then M's rank-0 chain (up to the same length). The
        chain's feeds are handed out (a draft model's shared cache batches them across requests)."""
        drafts, probs, _ = yield from self.inner.chain_steps(ctx, ctx.budget, self.tau_tail)
        tail: list[int] = []
        n_ctx = 0
        if self.variant == "tail" and drafts:
            if self.context and len(drafts) < ctx.budget:
                tail, vals = self._context_tail([*ctx.ids, *drafts], ctx.budget - len(drafts))
                n_ctx = len(tail)
                self._ctx["expected"] += sum(vals)
            x = tail[-1] if tail else drafts[-1]
            while len(drafts) + len(tail) < ctx.budget:
                x = int(self.matrix.table[x, 0])
                if x < 0:
                    break  # a cold row ends the tail
                tail.append(x)
        self.stages[f"kept{len(drafts)}"] += 1
        if probs is not None and tail:  # a deterministic candidate is a one-hot q: the q = 1 rule
            onehot = torch.zeros(len(tail), probs.shape[1], dtype=probs.dtype)
            onehot[torch.arange(len(tail)), torch.tensor(tail)] = 1
            probs = torch.cat([probs, onehot])
        sources = [SOURCE_DRAFT] * len(drafts) + [SOURCE_CONTEXT] * n_ctx + [SOURCE_RETRIEVAL] * (len(tail) - n_ctx)
        return Tree.chain(ctx.ids[-1], [*drafts, *tail], sources, probs)

    def _context_tail(self, ids: list[int], room: int) -> tuple[list[int], list[float]]:
        """The best context continuation after ``ids`` (committed + drafted) and its estimates, if its first
        token's estimate beats the matrix's rank-0 weight (ties: the matrix)."""
        matches = find_matches(ids, self.ctx_ngram, 1)
        self.counters["context_steps"] += 1
        if not matches:
            return [], []
        vals = self.ctx_model.values(matches[0], self._factor())[:room]
        if vals[0] <= (self.rank_weights or RANK_WEIGHTS)[0]:
            return [], []
        return list(matches[0].tokens[:room]), vals
