"""Batch mode: B requests verified together, a fixed number of tree slots per request (static shapes).

Ragged acceptance without copying: every step appends ``W`` slots per request to one shared KV cache and
keeps, per request, a ``valid`` flag per cache column; accepted nodes become valid, the rest stay as holes
that the additive mask hides. Positions are explicit, so holes never shift RoPE. When holes dominate, the
cache is compacted (one gather per layer)::

    request 0:  [ p p p p . | r a . . . | r . . . . ]     (. = hole, masked)
    request 1:  [ p p . . . | r a b . . | r a . . . ]     (prompt padded on the right)
    step 3 appends W columns for both; each row of the mask sees only its own valid columns + its tree.

Graft in batch mode (``variant="batch"``) drafts every request to full depth, picks the stage from the
recorded checkpoint confidences and replaces low-confidence draft nodes by retrieval nodes, keeping the
size; shorter trees are padded with dummy nodes that see only themselves and are never verified.
Drafting runs per request (each drafter keeps its own state); only the target forward is batched.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..core.backend import check_tree_support
from ..core.drafter import DraftContext
from ..errors import SpecgraftError
from ..core.sampling import SamplingParams, make_generator
from ..core.tree import Tree
from ..core.verify import verify_tree


class BatchBackend:
    def __init__(self, model: torch.nn.Module):
        check_tree_support(model.config)
        self.model = model.eval()
        self.dtype = next(model.parameters()).dtype
        self.neg = torch.finfo(self.dtype).min
        self.cache: DynamicCache | None = None
        self.valid: torch.Tensor | None = None  # bool [B, L]
        self.lengths: list[int] = []  # committed tokens per request (the next root's position)
        self.compactions = 0
        params = inspect.signature(model.forward).parameters  # transformers 5.x renamed past_key_values
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], hidden_layers: tuple[int, ...] = ()):
        """Right-padded prompts in one forward; per request its logits ``[T_b, V]`` and hidden states."""
        b, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(b, width, dtype=torch.long)
        self.valid = torch.zeros(b, width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            self.valid[i, : len(p)] = True
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool))
        visible = causal.unsqueeze(0) & self.valid.unsqueeze(1)
        visible |= torch.eye(width, dtype=torch.bool).unsqueeze(0)  # padding rows see themselves (no NaN)
        mask = torch.zeros(b, 1, width, width, dtype=self.dtype).masked_fill_(~visible.unsqueeze(1), self.neg)
        self.cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, position_ids=torch.arange(width).expand(b, -1), attention_mask=mask,
                         use_cache=True, **{self._cache_kw: self.cache}, output_hidden_states=bool(hidden_layers))
        self.lengths = [len(p) for p in prompts]
        logits = [out.logits[i, : len(p)] for i, p in enumerate(prompts)]
        hidden = [{h: out.hidden_states[h][i, : len(p)] for h in hidden_layers} if hidden_layers else None
                  for i, p in enumerate(prompts)]
        return logits, hidden

    @torch.inference_mode()
    def verify(self, trees: list[Tree], width: int, hidden_layers: tuple[int, ...] = ()):
        """One forward over ``B x width`` slots (trees padded with self-only dummies)."""
        b, length = len(trees), self.valid.shape[1]
        ids = torch.zeros(b, width, dtype=torch.long)
        pos = torch.zeros(b, width, dtype=torch.long)
        vis = torch.zeros(b, width, length + width, dtype=torch.bool)
        vis[:, :, :length] = self.valid.unsqueeze(1)
        for i, t in enumerate(trees):
            w = t.size
            ids[i, :w] = t.tokens
            pos[i, :w] = self.lengths[i] + t.depth
            pos[i, w:] = self.lengths[i]
            vis[i, :w, length: length + w] = t.ancestors
            vis[i, w:, :length] = False
            vis[i, w:, length + w:] = torch.eye(width - w, dtype=torch.bool)
        mask = torch.zeros(b, 1, width, length + width, dtype=self.dtype).masked_fill_(~vis.unsqueeze(1), self.neg)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                         **{self._cache_kw: self.cache}, output_hidden_states=bool(hidden_layers))
        self.valid = torch.cat([self.valid, torch.zeros(b, width, dtype=torch.bool)], 1)
        hidden = [{h: out.hidden_states[h][i] for h in hidden_layers} if hidden_layers else None for i in range(b)]
        return out.logits, hidden, length

    @torch.inference_mode()
    def commit(self, request: int, column0: int, accepted: list[int]) -> None:
        self.valid[request, torch.tensor(accepted) + column0] = True
        self.lengths[request] += len(accepted)

    @torch.inference_mode()
    def maybe_compact(self) -> None:
        """Gather each request's valid columns to the front once holes are over half the cache."""
        counts = self.valid.sum(1)
        keep = int(counts.max())
        if self.valid.shape[1] < 2 * keep + 64:
            return
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :keep]  # valid first, in order
        for layer in self.cache.layers:
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = torch.gather(layer.keys, 2, idx)
            layer.values = torch.gather(layer.values, 2, idx)
        self.valid = torch.arange(keep).unsqueeze(0) < counts.unsqueeze(1)
        self.compactions += 1


@dataclass
class BatchResult:
    outputs: list[list[int]]
    committed: list[list[int]] = field(default_factory=list)  # per request, tokens per step
    steps: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    compactions: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def mat(self) -> float:
        flat = [c for per in self.committed for c in per]
        return sum(flat) / len(flat) if flat else 0.0


def decode_batch(model, drafters: list, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int,
                 budget: int, eos_ids: set[int]) -> BatchResult:
    """Decode ``prompts`` together (one drafter per request); outputs equal each request decoded alone."""
    from ..engine import first_token

    t0 = time.perf_counter()
    backend = BatchBackend(model)
    layers = tuple(getattr(drafters[0], "hidden_layers", ()))
    logits, hidden = backend.prefill(prompts, layers)
    gens = [make_generator(None if params.seed is None else params.seed + i) for i in range(len(prompts))]
    res = BatchResult([[] for _ in prompts], [[] for _ in prompts])
    ids = []
    for i, (d, p) in enumerate(zip(drafters, prompts)):
        d.start(p, logits[i] if d.needs_prefill_logits else None, hidden[i])
        tok = first_token(logits[i][-1], params, gens[i])  # the same first token as the single-request loop
        ids.append([*p, tok])
        res.outputs[i].append(tok)
    done = [max_new_tokens <= 1 or out[-1] in eos_ids for out in res.outputs]
    width = budget + 1
    while not all(done):
        t1 = time.perf_counter()
        trees = [Tree.chain(ids[i][-1], []) if done[i] else d.propose(DraftContext(ids[i], budget, params))
                 for i, d in enumerate(drafters)]
        t2 = time.perf_counter()
        out_logits, out_hidden, col0 = backend.verify(trees, max(width, max(t.size for t in trees)), layers)
        t3 = time.perf_counter()
        for i, (d, tree) in enumerate(zip(drafters, trees)):
            if done[i]:
                continue
            lg = out_logits[i, : tree.size]
            verdict = verify_tree(tree, lg, params, gens[i])
            backend.commit(i, col0, verdict.accepted)
            hid = {h: v[: tree.size] for h, v in out_hidden[i].items()} if out_hidden[i] else None
            d.observe(tree, lg, verdict, hid)
            new = tree.tokens[verdict.accepted[1:]].tolist() + [verdict.bonus]
            cut = next((j + 1 for j, t in enumerate(new) if t in eos_ids), len(new))
            new = new[: min(cut, max_new_tokens - len(res.outputs[i]))]
            res.outputs[i].extend(new)
            res.committed[i].append(len(new))
            ids[i].extend(new)
            done[i] = len(res.outputs[i]) >= max_new_tokens or new[-1] in eos_ids
        backend.maybe_compact()
        res.steps += 1
        res.draft_s += (t2 - t1) + (time.perf_counter() - t3)
        res.verify_s += t3 - t2
    res.wall_s = time.perf_counter() - t0
    res.compactions = backend.compactions
    return res


def clone_drafter(d, shared_matrix=None):
    """A fresh per-request copy of a drafter sharing its weights (and, for Graft, one shared matrix)."""
    from ..drafters.draft_model import DraftModelDrafter
    from ..eagle.drafter import EagleDrafter
    from ..graft.drafter import GraftDrafter

    if isinstance(d, EagleDrafter):
        return EagleDrafter(d.head, d.label, d.top_k, d.depth)
    if isinstance(d, DraftModelDrafter):
        return DraftModelDrafter(d.backend.model, d.label, d.shape, d.top_k, d.depth)
    if isinstance(d, GraftDrafter):
        c = GraftDrafter(clone_drafter(d.inner), d.matrix.table.shape[0], d.variant, d.policy, d.matrix.k,
                         "global", None, d.dedup, d.tau_tail, d.rank_weights, d.name, d.calibration, d.sweep,
                         d.matrix_source, d.calibration_info)
        c.matrix, c.requests = shared_matrix or d.matrix, 1  # "global": start() must not reset the shared table
        c.snapshot = d.snapshot  # for the record ("warm"); already loaded into the shared table
        return c
    raise ValueError(f"batch mode supports eagle, draft-model and graft drafters, not '{d.name}'")


def batch_drafters(engine, method: str, options: dict, n: int) -> list:
    """``n`` drafters for one batch; Graft's share one matrix, loaded from its warm-up snapshot."""
    from ..graft.drafter import GraftDrafter
    from ..drafters.recycling import AdjacencyMatrix

    proto = engine.drafter(method, **options)
    shared = None
    if isinstance(proto, GraftDrafter):
        shared = AdjacencyMatrix(engine.vocab_size, proto.matrix.k)
        if proto.snapshot is not None:
            shared.load_snapshot(proto.snapshot)
    return [clone_drafter(proto, shared) for _ in range(n)]


def run_batch_bench(engine, specs: list, prompts: list[list[int]], batch_sizes: list[int], max_new_tokens: int,
                    out_path, progress=None) -> list[dict]:
    """Throughput per (batch size, method), methods interleaved per batch size, warm-up first; resumable
    (one JSONL record per finished pair). Greedy outputs are compared with the batch-size-1 outputs."""
    import json
    from pathlib import Path

    from ..registry import DEFAULTS
    from .harness import environment

    out_path = Path(out_path)
    done = {}
    if out_path.exists():
        for line in out_path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[(r["label"], r["batch_size"])] = r
    env = environment()
    greedy = SamplingParams()
    lossy = [s.label for s in specs if s.verify != "lossless" or s.sampling]
    if lossy:
        raise SpecgraftError(f"batch mode is greedy and lossless; remove verify/min_p/eta from: {', '.join(lossy)}")
    for spec in specs:  # warm-up: one short batch per method
        opts = {k: v for k, v in spec.options.items() if k != "budget"}
        budget = spec.options.get("budget", DEFAULTS[spec.method]["budget"])
        decode_batch(engine.backend.model, batch_drafters(engine, spec.method, opts, 2), prompts[:2], greedy, 8,
                     budget, engine.eos_ids)
    total, n = len(specs) * len(batch_sizes), 0
    for bsz in batch_sizes:
        for spec in specs:
            n += 1
            if (spec.label, bsz) in done:
                continue
            opts = {k: v for k, v in spec.options.items() if k != "budget"}
            budget = spec.options.get("budget", DEFAULTS[spec.method]["budget"])
            outs, res_all = [], BatchResult([])
            for s in range(0, len(prompts), bsz):
                chunk = prompts[s: s + bsz]
                r = decode_batch(engine.backend.model, batch_drafters(engine, spec.method, opts, len(chunk)), chunk,
                                 greedy, max_new_tokens, budget, engine.eos_ids)
                outs.extend(r.outputs)
                res_all.committed.extend(r.committed)
                res_all.steps += r.steps
                for f in ("wall_s", "draft_s", "verify_s", "compactions"):
                    setattr(res_all, f, getattr(res_all, f) + getattr(r, f))
            res_all.outputs = outs
            single = done.get((spec.label, 1))
            rec = {"label": spec.label, "method": spec.method, "options": spec.options, "batch_size": bsz,
                   "prompts": len(prompts), "max_new_tokens": max_new_tokens, "tokens": res_all.tokens,
                   "wall_s": res_all.wall_s, "throughput": res_all.throughput, "mat": res_all.mat,
                   "steps": res_all.steps, "draft_s": res_all.draft_s, "verify_s": res_all.verify_s,
                   "compactions": res_all.compactions, "outputs": outs,
                   "equal_to_batch1": None if single is None else single["outputs"] == outs,
                   "model": engine.model_name, "dtype": engine.dtype, "env": env}
            done[(spec.label, bsz)] = rec
            with open(out_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if progress:
                progress(n, total, f"B={bsz} {spec.label}: {rec['throughput']:.2f} tok/s")
    return [done[(s.label, b)] for b in batch_sizes for s in specs]
