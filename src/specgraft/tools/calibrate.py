"""Run a Graft calibration (`specgraft calibrate`) on the engine loop: warm-up rounds decoded greedily with
the unpruned drafter wrapped in a :class:`~.calibration.Recorder`, optional teacher-forced conversations, then
the fits of :mod:`.calibration`. Resumable per round.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..drafters.dynamic_tree import InnerDrafter
from ..core.drafter import last_occurrences
from ..drafters.matrix import AdjacencyMatrix
from ..engine import Engine
from ..text import chat_ids
from ..errors import SpecgraftError
from ..graft.context import fit_context
from ..graft.calibration import FALLBACK_TAU_TAIL, MIN_OBS, Calibration, Recorder, fit_threshold
from ..graft.pruning import CHECKPOINTS, FALLBACK_THRESHOLDS


def teacher_forced(engine: Engine, messages: list[dict], matrix, max_len: int = 1024) -> int:
    """One prefill over a whole conversation; every position writes its token's row. Returns tokens read."""
    ids = chat_ids(engine.tokenizer, messages, add_generation_prompt=False)[:max_len]
    out = engine.backend.add(torch.tensor(ids, dtype=torch.long), torch.tensor(last_occurrences(ids)))
    engine.backend.remove(engine.backend.rows - 1)  # read, not decoded: the row leaves at once
    matrix.update_prompt(ids, out.logits)
    return len(ids)


def warmup_ids(engine: Engine, messages: list[dict]) -> list[int]:
    """A warm-up round's prompt: the conversation's first user turn (its last 1024 tokens)."""
    first = next(m for m in messages if m["role"] == "user")
    return engine.encode([first])[-1024:]


def refit_context(engine: Engine, cal: Calibration, conversations: list[tuple[str, list[dict]]],
                  progress=None) -> Calibration:
    """Add the context table to an existing calibration from the same warm-up prompts and length: decoded
    greedily with prompt lookup (lossless, so the same text the calibration's own decode produced), unless the
    calibration already stored its decodes. Thresholds and matrix are left as they are."""
    if not cal.sequences and not all(isinstance(cal.meta.get(k), int) for k in ("rounds", "max_new_tokens")):
        raise SpecgraftError("this calibration does not record its warm-up rounds and length; run a full "
                             "`specgraft calibrate` instead of --context-only")
    rounds, max_new = int(cal.meta.get("rounds", 0)), int(cal.meta.get("max_new_tokens", 0))
    if not cal.sequences:
        if len(conversations) < rounds:
            raise SpecgraftError(f"the calibration recorded {rounds} warm-up rounds; its data now has "
                                 f"{len(conversations)} conversations")
        cal.sequences = greedy_decodes(engine, conversations[:rounds], max_new, progress)
    return refit_table(cal)


def greedy_decodes(engine: Engine, conversations: list[tuple[str, list[dict]]], max_new: int,
                   progress=None) -> list[list[int]]:
    """Each conversation's first user turn decoded greedily with prompt lookup (lossless: AR's text), stored as
    ``[prompt length, *prompt, *output]``."""
    seqs = []
    for r, (_, messages) in enumerate(conversations):
        ids = warmup_ids(engine, messages)
        out = engine.generate(ids, "pld", max_new_tokens=max_new)
        seqs.append([len(ids), *ids, *out.token_ids])
        if progress:
            progress(r + 1, len(conversations), f"decode: {len(out.token_ids)} tokens")
    return seqs


def refit_table(cal: Calibration) -> Calibration:
    """The context table fitted on the warm-up decodes and every added source's decodes."""
    if any("sequences" not in src for src in cal.context_sources):
        raise SpecgraftError("a context source in this calibration has no decodes (`sequences`); add it again with "
                             "`specgraft calibrate --context-only --data`")
    seqs = [*cal.sequences, *(s for src in cal.context_sources for s in src["sequences"])]
    cal.context = fit_context([(s[1:], s[0]) for s in seqs])
    return cal


SOURCE_KEYS = ("data", "skip", "rounds", "max_new_tokens", "backend", "weights")


def add_context_source(engine: Engine, cal: Calibration, source: dict, conversations: list[tuple[str, list[dict]]],
                       progress=None) -> Calibration:
    """Decode ``source["rounds"]`` of ``conversations`` greedily (prompt lookup: lossless, AR's text) and refit
    the context table on the warm-up decodes plus every added source's. ``source`` names the decodes
    (``SOURCE_KEYS``); a source with the same settings replaces the earlier one, and one already decoded for
    another calibration of the same target (``source["sequences"]``) is reused as it is."""
    if not cal.sequences:
        raise SpecgraftError("this calibration keeps no warm-up decodes to fit beside the added data; run "
                             "`specgraft calibrate --context-only` without --data first")
    rounds, max_new = int(source["rounds"]), int(source["max_new_tokens"])
    if len(conversations) < rounds:
        raise SpecgraftError(f"--data {source['data']} past --skip {source['skip']} has {len(conversations)} "
                             f"conversations, fewer than --rounds {rounds}")
    if "sequences" not in source:
        source = {**source, "sequences": greedy_decodes(engine, conversations[:rounds], max_new, progress)}
    key = tuple(source.get(k) for k in SOURCE_KEYS)
    cal.context_sources = [s for s in cal.context_sources if tuple(s.get(k) for k in SOURCE_KEYS) != key]
    cal.context_sources.append(source)
    return refit_table(cal)


def run_calibration(engine: Engine, inner: InnerDrafter, conversations: list[tuple[str, list[dict]]], rounds: int,
                    max_new_tokens: int, budget: int, extra: int = 0, rho: float = 0.5, k: int = 8, progress=None,
                    state_path: Path | None = None) -> Calibration:
    """Warm-up + calibration; resumable per round through ``state_path`` (a torch file)."""
    matrix = AdjacencyMatrix(engine.vocab_size, k)
    rec = Recorder(inner, matrix)
    state = {"round": 0, "extra": 0, "seconds": 0.0, "tokens": 0, "steps": 0, "draft_s": 0.0, "verify_s": 0.0}
    sequences: list[list[int]] = []
    if state_path is not None and state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        state = saved["state"]
        sequences = saved.get("sequences", [])
        matrix.load_snapshot(saved["snapshot"])
        for key in ("conf", "outcome", "tail_conf", "tail_outcome", "ranks", "rank_hits"):
            setattr(rec, key, saved[key])
        rec.rank_trials = saved["rank_trials"]
    if len(conversations) < rounds + extra:
        raise SpecgraftError(f"calibration needs {rounds + extra} conversations, the data has {len(conversations)}")
    total = rounds + extra

    def checkpoint() -> None:
        if state_path is None:
            return
        body = {"state": state, "snapshot": matrix.snapshot(), "rank_trials": rec.rank_trials, "sequences": sequences,
                **{key: getattr(rec, key) for key in ("conf", "outcome", "tail_conf", "tail_outcome", "ranks",
                                                       "rank_hits")}}
        torch.save(body, state_path.with_suffix(".tmp"))
        state_path.with_suffix(".tmp").replace(state_path)

    while state["extra"] < extra:
        t0 = time.perf_counter()
        _, messages = conversations[rounds + state["extra"]]
        teacher_forced(engine, messages, matrix)
        state["extra"] += 1
        state["seconds"] += time.perf_counter() - t0
        checkpoint()
        if progress:
            progress(state["round"] + state["extra"], total, "teacher-forced conversation")
    while state["round"] < rounds:
        t0 = time.perf_counter()
        ids = warmup_ids(engine, conversations[state["round"]][1])
        engine.add_request(ids, "calibrate", drafter=rec, max_new_tokens=max_new_tokens, budget=budget)
        result = next(iter(engine.run().values()))
        stats = result.stats
        sequences.append([len(ids), *ids, *result.token_ids])  # the context table is fitted on these
        state["round"] += 1
        state["tokens"] += stats.new_tokens
        state["steps"] += stats.steps
        state["draft_s"] += stats.draft_s
        state["verify_s"] += stats.verify_s
        state["seconds"] += time.perf_counter() - t0
        checkpoint()
        if progress:
            progress(state["round"] + state["extra"], total, f"round: {stats.new_tokens} tokens, MAT {stats.mat:.2f}")

    fits, taus = {}, []
    for d, fb in zip(CHECKPOINTS, FALLBACK_THRESHOLDS):
        tau, info = fit_threshold(rec.conf[d], rec.outcome[d], rho, fb)
        fits[str(d)] = info
        taus.append(tau)
    tau_tail, tail_info = fit_threshold(rec.tail_conf, rec.tail_outcome, rho, FALLBACK_TAU_TAIL)
    weights = None
    if rec.rank_trials >= MIN_OBS:  # measured hit rates replace the prior (floor keeps every rank usable)
        weights = tuple(round(max(h / rec.rank_trials, 1e-3), 4) for h in rec.rank_hits)
    meta = {"rounds": rounds, "extra_conversations": extra, "max_new_tokens": max_new_tokens, "budget": budget,
            "rho": rho, "k": k, "fits": fits, "tail_fit": tail_info, "rank_trials": rec.rank_trials,
            "rank_hits": rec.rank_hits, "rows_filled": matrix.rows_filled,
            "populated_bytes": matrix.populated_bytes, **state,
            "draft_s_per_step": state["draft_s"] / max(state["steps"], 1),
            "date": time.strftime("%Y-%m-%d"), "model": engine.model_name, "dtype": engine.dtype}
    return Calibration(tuple(taus), CHECKPOINTS, tau_tail, weights, meta, matrix.snapshot(), rec.ranks,
                       fit_context([(s[1:], s[0]) for s in sequences]), sequences)
