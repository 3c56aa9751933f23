"""Benchmark harness: methods from a config (with sweeps), interleaved per prompt, AR always the baseline,
one JSONL record per turn, resumable.

Protocol: one process, one loaded model; a warm-up generation per method before anything is timed, on a
fixed prompt that is in no dataset (so no evaluation prompt's successors are in a retrieval matrix before its
timed run); for each prompt every method runs back to back, the order rotated by one place per prompt over the
whole run (across datasets and seeds, so no method always runs first); fixed seeds; multi-turn
conversations run turn by turn with the chat template, each method continuing its own previous answers.
A conversation's records are written together and flushed, so an interrupted run resumes at the first
conversation that is not complete (a half-written last line is dropped on resume).
"""

from __future__ import annotations

import itertools
import json
import os
import time
import tomllib
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..backend_choice import AUTO as BACKEND_AUTO
from ..core.sampling import TRUNCATION_KEYS, SamplingParams
from ..engine import Engine
from ..env import environment
from ..errors import SpecgraftError
from ..lossy.rules import parse_rule
from ..models import resolve_dtype
from ..registry import LOOP_KEYS, check_lossy, check_options
from .datasets import Item, load_dataset
from .quality import score

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class MethodSpec:
    label: str
    method: str
    options: dict = field(default_factory=dict, hash=False)  # the drafter's options (and budget)
    verify: str = "lossless"  # or an opt-in LOSSY rule "lossy:RULE:PARAM"
    sampling: dict = field(default_factory=dict, hash=False)  # per-method truncation sampling: min_p, eta
    backend: str = ""  # where this method runs when not the config's backend (e.g. llama.cpp's AR beside int4)
    dtype: str = ""  # and its weights when not the config's dtype

    def engine_key(self, cfg: "BenchConfig") -> tuple[str, str]:
        """(backend, dtype) with dtype ``auto`` resolved (two spellings of one engine's weights share it), except
        under ``--backend auto``, which scores both dense dtypes itself."""
        backend, dtype = self.backend or cfg.backend, self.dtype or cfg.dtype
        return (backend, dtype if backend == BACKEND_AUTO else resolve_dtype(dtype, cfg.device))

    def params(self, base: SamplingParams) -> SamplingParams:
        return replace(base, **self.sampling) if self.sampling else base

    def describe(self) -> dict:
        """The configuration without its label: equal for two runs of one configuration (the noise pairs)."""
        out = {"method": self.method, "options": dict(sorted(self.options.items())), "verify": self.verify,
               "sampling": dict(sorted(self.sampling.items()))}
        return out | {k: v for k, v in (("backend", self.backend), ("dtype", self.dtype)) if v}


# Keys a method entry may carry besides its drafter options: the verification rule and truncation sampling
# (the correct baselines of the lossy truncation rules), ``label`` (two entries of one configuration under
# different labels measure the run's noise), and ``backend`` / ``dtype`` (a method on other weights or another
# runtime in the same interleaved run: one engine each).
ENGINE_KEYS = ("backend", "dtype")

# The warm-up prompt: outside every dataset, so warming up never runs (or retrieves from) an evaluation prompt.
WARMUP_PROMPT = "List four uses of a paperclip, one per line, then say which is the most surprising and why."


@dataclass
class BenchConfig:
    model: str = "smollm2-135m"
    dtype: str = "bfloat16"  # or "auto" (models.resolve_dtype); records name the dtype that ran
    backend: str = "transformers"  # or "llamacpp": the GGUF on llama.cpp (dtype is then the GGUF's own)
    device: str = "cpu"  # transformers backend: cpu, cuda or auto
    max_new_tokens: int = 128
    warmup: int = 1
    seeds: list[int] = field(default_factory=lambda: [0])
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    datasets: list[dict] = field(default_factory=lambda: [{"name": "mtbench", "limit": 8, "stride": 10}])
    methods: list[dict] = field(default_factory=lambda: [{"name": "pld"}, {"name": "recycle"}])
    score: bool = True
    ar: bool = True  # add the AR baseline (speedups need it; a follow-up run of extra seeds may skip it)
    # Conversations in flight at once through the one engine loop. ``batch`` consecutive prompts form a group;
    # each method runs its group's conversations together (the method order rotated per group), so a record's
    # speed is measured beside neighbours of the same configuration only.
    batch: int = 1
    # False: sampled requests of a group share batched draft forwards too (faster; each sample then depends on
    # its neighbours' rounding, its distribution does not). The target's verify is batched either way.
    batch_invariant: bool = True

    @staticmethod
    def from_toml(path: str) -> "BenchConfig":
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise SpecgraftError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as err:
            raise SpecgraftError(f"{path}: invalid TOML ({err})") from None
        known = set(BenchConfig.__dataclass_fields__)
        unknown = set(raw) - known
        if unknown:
            raise SpecgraftError(f"{path}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        cfg = BenchConfig(**raw)
        if not isinstance(cfg.batch, int) or isinstance(cfg.batch, bool) or cfg.batch < 1:
            raise SpecgraftError(f"{path}: batch must be an integer >= 1, got {cfg.batch!r}")
        return cfg

    def sampling(self, seed: int) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, seed)


def expand_methods(entries: list[dict], add_ar: bool = True) -> list[MethodSpec]:
    """``{"name": "recycle", "budget": [16, 80]}`` -> one spec per combination; AR is added first if absent
    (unless ``add_ar`` is False)."""
    specs = []
    for entry in entries:
        entry = dict(entry)
        name = entry.pop("name", None)
        check_options(name, entry, (*LOOP_KEYS, *ENGINE_KEYS))
        keys = sorted(entry)
        values = [v if isinstance(v, list) else [v] for v in (entry[k] for k in keys)]
        for combo in itertools.product(*values):
            opts = dict(zip(keys, combo))
            custom = opts.pop("label", None)
            label = custom or name + (":" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")
            verify = opts.pop("verify", "lossless")
            samp = {k: opts.pop(k) for k in TRUNCATION_KEYS if k in opts}
            where = {k: str(opts.pop(k)) for k in ENGINE_KEYS if k in opts}
            specs.append(MethodSpec(label, name, opts, verify, samp, **where))
    if add_ar and not any(s.method == "ar" for s in specs):
        specs.insert(0, MethodSpec("ar", "ar", {}))
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise SpecgraftError(f"duplicate method entries: {labels}")
    return specs


def parse_method(spec: str) -> dict:
    """CLI form ``name`` or ``name:key=value,key=value`` -> a config entry (numbers parsed)."""
    name, _, rest = spec.strip().partition(":")
    entry: dict = {"name": name}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            raise SpecgraftError(f"bad method option '{item}' in '{spec}' (expected key=value)")
        for cast in (int, float):
            try:
                val = cast(val)
                break
            except ValueError:
                pass
        entry[key.strip()] = val
    return entry


def parse_opts(opt: list[str]) -> dict:
    """``--opt k=v`` (repeatable) as method options; the budget has its own flag."""
    extra = {k: v for o in opt for k, v in parse_method("x:" + o).items() if k != "name"}
    if "budget" in extra:
        raise SpecgraftError("set the budget with --budget, not --opt budget=...")
    return extra


def parse_budget(budget: str | None):
    """``--budget``: an integer, ``auto`` or None (the method's default)."""
    if budget is None or budget == "auto":
        return budget
    try:
        return int(budget)
    except ValueError:
        raise SpecgraftError(f"--budget must be an integer or 'auto', got '{budget}'") from None


def record_key(rec: dict) -> tuple:
    return rec["dataset"], rec["prompt_id"], rec["label"], rec["seed"]


def read_records(path: str | Path) -> tuple[list[dict], list[str]]:
    """Parse a records file; problems (truncated or unparsable lines) are returned, not raised."""
    p = Path(path)
    if not p.exists():
        return [], []
    raw = p.read_text(encoding="utf-8", errors="replace")
    records, problems = [], []
    lines = raw.split("\n")
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            problems.append(f"{p}:{n}: truncated or invalid record")
            continue
        if n == len(lines):  # parsed, but the write of its newline never happened
            problems.append(f"{p}:{n}: last record has no newline (interrupted write)")
    return records, problems


def complete_conversations(records: list[dict]) -> tuple[list[dict], set]:
    """Records of conversations whose every turn is present; and their keys."""
    by_key: dict[tuple, list[dict]] = {}
    for r in records:
        by_key.setdefault(record_key(r), []).append(r)
    keep = {k for k, rs in by_key.items() if len({r["turn"] for r in rs}) == rs[0]["n_turns"]}
    return [r for r in records if record_key(r) in keep], keep


def repair_for_resume(path: str | Path) -> tuple[set, int]:
    """Rewrite ``path`` (atomically) keeping only complete conversations; return their keys, lines dropped."""
    records, problems = read_records(path)
    kept, keys = complete_conversations(records)
    dropped = len(records) - len(kept) + len(problems)
    if dropped:
        tmp = Path(str(path) + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)
    return keys, dropped


def run_order(seeds: list[int], plan: list[tuple[str, list[Item]]]) -> list[tuple[int, str, Item]]:
    """Every (seed, dataset, item) of the run, in the order they run."""
    return [(seed, dname, item) for seed, (dname, items) in itertools.product(seeds, plan) for item in items]


def rotated(specs: list, g: int) -> list:
    """The method order for the run's ``g``-th prompt: rotated by ``g`` places (each method leads in turn)."""
    k = g % len(specs)
    return specs[k:] + specs[:k]


def run_conversation(engine, item: Item, spec: MethodSpec, sampling: SamplingParams, max_new_tokens: int,
                     stop: tuple[str, ...] = ()):
    messages, out = [], []
    for turn in item.turns:
        messages.append({"role": "user", "content": turn})
        g = engine.generate(messages, spec.method, sampling=spec.params(sampling), verify=spec.verify,
                            max_new_tokens=max_new_tokens, stop=stop, **spec.options)
        messages.append({"role": "assistant", "content": g.text})
        out.append(g)
    return out


@dataclass
class Conversation:
    """One conversation of a batched group: its messages so far and one Generation per finished turn."""

    key: tuple  # (seed, dataset, item)
    messages: list = field(default_factory=list)
    gens: list = field(default_factory=list)


def run_group(engine, jobs: list[tuple[int, str, Item]], spec: MethodSpec, cfg: "BenchConfig",
              stops: dict) -> tuple[list[Conversation], float]:
    """Every conversation of ``jobs`` in flight together through the engine loop (a conversation's next turn
    joins when its previous one finishes); returns them in ``jobs`` order and the group's wall seconds. A
    request that fails stops the run (it is resumable) with one clear error."""
    if engine.active:
        raise SpecgraftError("a batched group needs an idle engine")
    convs = [Conversation(job) for job in jobs]
    in_flight: dict[int, Conversation] = {}

    def submit(conv: Conversation) -> None:
        seed, dname, item = conv.key
        conv.messages.append({"role": "user", "content": item.turns[len(conv.gens)]})
        rid = engine.add_request(list(conv.messages), spec.method, sampling=spec.params(cfg.sampling(seed)),
                                 verify=spec.verify, max_new_tokens=cfg.max_new_tokens, stop=stops[dname],
                                 **spec.options)
        in_flight[rid] = conv

    t0, invariant = time.perf_counter(), engine.batch_invariant
    engine.batch_invariant = cfg.batch_invariant
    try:
        for conv in convs:
            submit(conv)
        _drain(engine, in_flight, spec, submit)
    except BaseException:  # the engine is left idle for whatever runs next (the run itself resumes)
        try:
            for rid in list(in_flight):
                engine.abort(rid)
            engine.run()
        except Exception:  # noqa: BLE001 -- the original error is the one to report
            pass
        raise
    finally:
        engine.batch_invariant = invariant
    return convs, time.perf_counter() - t0


def _drain(engine, in_flight: dict, spec: MethodSpec, submit) -> None:
    """Step until the group is done; a finished turn's conversation submits its next turn."""
    while engine.has_unfinished():
        for out in engine.step():
            if not out.finished:
                continue
            conv = in_flight.pop(out.request_id)
            if out.error or out.result is None:
                raise SpecgraftError(f"{spec.label} on {conv.key[1]} {conv.key[2].id} failed: {out.error}")
            conv.gens.append(out.result)
            conv.messages.append({"role": "assistant", "content": out.result.text})
            if len(conv.gens) < len(conv.key[2].turns):
                submit(conv)


def make_record(cfg: BenchConfig, env: dict, dataset: str, item: Item, spec: MethodSpec, seed: int, turn: int,
                g, scorer, group: dict | None = None) -> dict:
    s = g.stats
    rec = {
        "schema": SCHEMA_VERSION, "dataset": dataset, "prompt_id": item.id, "category": item.category,
        "turn": turn, "n_turns": len(item.turns), "seed": seed, "label": spec.label, "method": spec.method,
        "spec": spec.describe(),
        "method_config": g.config, "model": cfg.model, "dtype": g.config["dtype"], "backend": g.config.get("backend", "transformers"),
        "device": g.config.get("device", "cpu"),
        "max_new_tokens": cfg.max_new_tokens,
        "sampling": g.config["sampling"], "greedy": cfg.temperature == 0.0,
        "verify": g.config.get("verify", "lossless"), "lossy": bool(g.config.get("lossy", False)),
        "machine": {k: env[k] for k in ("cpu", "cpu_id", "amx", "isa", "cores", "threads")},
        "versions": {k: env[k] for k in ("python", "torch", "transformers", "specgraft")},
        "commit": env["commit"], "dirty": env["dirty"],
        "prompt_tokens": len(g.prompt_ids), "output_ids": g.token_ids, "text": g.text,
        "new_tokens": s.new_tokens, "steps": s.steps, "accept_lengths": [c - 1 for c in s.committed],
        "mat": s.mat, "depth_trials": s.depth_trials, "depth_accepts": s.depth_accepts,
        "tree_nodes": s.tree_nodes, "wall_s": s.total_s, "prefill_s": s.prefill_s, "draft_s": s.draft_s,
        "verify_s": s.verify_s, "other_s": s.other_s, "retrieval_state": s.retrieval_state,
    }
    if group is not None:  # batched: the group this turn ran in, for throughput (wall_s is its own latency)
        rec["batch"] = group
    if scorer and turn == len(item.turns) - 1:
        rec["quality"] = scorer(item.task, item.reference, g.text)
    return rec


def run_harness(cfg: BenchConfig, out_path: str, progress=None, log=print, engine=None) -> dict:
    """Run (or resume) a benchmark into ``out_path``; returns counts of what ran and what was skipped."""
    specs = expand_methods(cfg.methods, cfg.ar)
    for seed in cfg.seeds:
        for spec in specs:  # validate before loading anything
            params = spec.params(cfg.sampling(seed))
            rule = parse_rule(spec.verify)
            if rule.lossy:
                check_lossy(rule, spec.method, spec.options, params)
    stops = {d.get("name"): tuple(d.get("stop", ())) for d in cfg.datasets}  # per dataset, e.g. a code fence
    plan = [(d.get("name"), load_dataset(d["name"], d.get("limit"), d.get("stride", 1), d.get("categories"),
                                         d.get("path"), d.get("max_turns"), d.get("offset", 0)))
            for d in cfg.datasets]
    complete, dropped = repair_for_resume(out_path) if Path(out_path).exists() else (set(), 0)
    if complete or dropped:
        log(f"resume: {len(complete)} conversations already recorded; {dropped} incomplete line(s) dropped")
    engines = {MethodSpec("", "").engine_key(cfg): engine} if engine else {}
    for key in dict.fromkeys(spec.engine_key(cfg) for spec in specs):  # one engine per (backend, weights)
        if key not in engines:
            engines[key] = Engine(cfg.model, key[1], backend=key[0], device=cfg.device)
    env = environment()
    for spec in specs:
        engine = engines[spec.engine_key(cfg)]
        engine.drafter(spec.method, **spec.options)
        for _ in range(cfg.warmup):
            engine.generate(WARMUP_PROMPT, spec.method, sampling=spec.params(cfg.sampling(cfg.seeds[0])),
                            verify=spec.verify, max_new_tokens=min(32, cfg.max_new_tokens), **spec.options)
    order = run_order(cfg.seeds, plan)
    total = len(order) * len(specs)
    ran = skipped = 0
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a", encoding="utf-8") as out:

        def write(lines: list[str]) -> None:
            out.write("\n".join(lines) + "\n")
            out.flush()
            os.fsync(out.fileno())

        for g in range(0, len(order), cfg.batch):
            chunk = order[g: g + cfg.batch]
            for spec in rotated(specs, g // cfg.batch):
                todo = [job for job in chunk if (job[1], job[2].id, spec.label, job[0]) not in complete]
                skipped += len(chunk) - len(todo)
                engine = engines[spec.engine_key(cfg)]
                if cfg.batch == 1:
                    for seed, dname, item in todo:
                        gens = run_conversation(engine, item, spec, cfg.sampling(seed), cfg.max_new_tokens,
                                                stops[dname])
                        write([json.dumps(make_record(cfg, env, dname, item, spec, seed, t, gen,
                                                      score if cfg.score else None)) for t, gen in enumerate(gens)])
                elif todo:
                    convs, wall = run_group(engine, todo, spec, cfg, stops)
                    # ``id``: this run of the group (a resumed group reruns only its missing conversations)
                    group = {"size": cfg.batch, "group": g // cfg.batch, "id": uuid.uuid4().hex[:12],
                             "in_flight": len(todo), "wall_s": wall,
                             "invariant": cfg.batch_invariant,
                             "new_tokens": sum(gen.stats.new_tokens for c in convs for gen in c.gens)}
                    for c in convs:
                        seed, dname, item = c.key
                        write([json.dumps(make_record(cfg, env, dname, item, spec, seed, t, gen,
                                                      score if cfg.score else None, group))
                               for t, gen in enumerate(c.gens)])
                ran += len(todo)
                if progress:
                    seed, dname, item = chunk[-1]
                    progress(ran + skipped, total, f"{dname} {item.id} {spec.label} seed={seed}")
    return {"ran": ran, "skipped": skipped, "total": total}

