"""Per-backend costs on this machine (docs/benchmarks.md, "Backends"): one forward over n new tree tokens after a
fixed prefix, prefill time against prompt length, peak resident memory, and where a transformers step's time goes.

    python scripts/backend_costs.py verify  --backend transformers --dtype bfloat16   # n = 1..64
    python scripts/backend_costs.py verify  --backend llamacpp
    python scripts/backend_costs.py prefill --backend llamacpp --ubatch 512
    python scripts/backend_costs.py memory  --backend llamacpp        # run each backend in its own process
    python scripts/backend_costs.py profile                           # torch profiler, one transformers AR step
    python scripts/backend_costs.py floor --dtype int4                # the weights' memory floor: one read of each
    python scripts/backend_costs.py llama-widths                      # llama.cpp: the GGUF, its gguf-q8 variant,
                                                                      # and the hidden-state tap, interleaved
    python scripts/backend_costs.py packed-ab --dtype float32          # plain vs prepacked layers, interleaved
    python scripts/backend_costs.py dtype-ab                          # fp32 vs bf16 as loaded here (--dtype auto)
    python scripts/backend_costs.py hint-ab --dtype float32 --hints 1 16  # packed layouts for other row counts

Each prints one JSON line (and a table on stderr). Timings are medians of ``--reps`` after one warm-up; the
prefix and prompts are token ids of a fixed text (no evaluation prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

TEXT = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill and the miller counts "
        "his sacks of flour one by one before the market opens in the square. ") * 200


def engine(args):
    from specgraft import Engine

    if args.backend == "llamacpp" and (args.ubatch or args.flash_attn is not None):
        from specgraft.backends import llamacpp as L
        from specgraft.models import gguf_file

        e = Engine(args.model, backend="llamacpp")
        s = L.LlamaSettings(n_ubatch=args.ubatch or 512, n_batch=max(512, args.ubatch or 512),
                            flash_attn=-1 if args.flash_attn is None else args.flash_attn)
        e.backend = L.LlamaCppBackend(L.LlamaModel(gguf_file(args.model)[0], s), s)
        return e
    return Engine(args.model, args.dtype, backend=args.backend)


def ids_of(e, n: int) -> list[int]:
    ids = e.tokenizer(TEXT).input_ids
    return (ids * (n // len(ids) + 1))[:n]


def timed(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def verify(args) -> dict:
    from specgraft.core.tree import Tree

    e = engine(args)
    be = e.backend
    prefix = ids_of(e, args.prefix)
    be.prefill(torch.tensor(prefix))
    res = {}
    for n in args.n:
        tree = Tree.chain(prefix[-1], prefix[1:n])  # a chain of n tokens (trees of n cost the same here)

        def step():
            be.verify(tree)
            be.truncate(args.prefix)

        res[n] = round(timed(step, args.reps) * 1000, 1)
        print(f"n={n:3d} {res[n]:7.1f} ms", file=sys.stderr, flush=True)
    return {"what": "verify_ms", "backend": args.backend, "dtype": e.dtype, "model": args.model,
            "prefix": args.prefix, "ms": res}


def prefill(args) -> dict:
    e = engine(args)
    be = e.backend
    res = {}
    for n in args.lengths:
        ids = torch.tensor(ids_of(e, n))
        t = timed(lambda: be.prefill(ids), args.reps)
        res[n] = {"ms": round(t * 1000, 1), "tok_s": round(n / t, 1)}
        print(f"prompt {n:5d}: {t * 1000:8.1f} ms  {n / t:7.1f} tok/s", file=sys.stderr, flush=True)
    return {"what": "prefill", "backend": args.backend, "dtype": e.dtype, "model": args.model,
            "ubatch": args.ubatch, "flash_attn": args.flash_attn, "lengths": res}


def memory(args) -> dict:
    e = engine(args)
    g = e.generate("Write a Python function that merges two sorted lists.", "ar", max_new_tokens=64)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return {"what": "peak_rss_mib", "backend": args.backend, "dtype": e.dtype, "model": args.model,
            "peak_rss_mib": round(peak), "tokens": g.stats.new_tokens}


def profile(args) -> dict:
    """Where one transformers AR step (a 1-token verify + commit) spends its time."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    from specgraft.core.tree import Tree

    e = engine(args)
    be = e.backend
    prefix = ids_of(e, args.prefix)
    be.prefill(torch.tensor(prefix))
    tok = prefix[-1]

    def step():
        be.verify(Tree.chain(tok, []))
        be.commit([0])

    for _ in range(3):
        step()
    wall = timed(step, args.reps)
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.reps):
            step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    print(table, file=sys.stderr)
    total = sum(k.self_cpu_time_total for k in prof.key_averages())
    top = {k.key: round(k.self_cpu_time_total / total, 3) for k in
           sorted(prof.key_averages(), key=lambda k: -k.self_cpu_time_total)[:12]}
    return {"what": "profile", "backend": "transformers", "dtype": e.dtype, "model": args.model,
            "ar_step_ms": round(wall * 1000, 1), "self_cpu_share": top}


def floor(args) -> dict:
    """The memory floor of one step: every weight tensor a step reads (the embedding table is only gathered from)
    read once, in order, as 32-bit words (``max``: one pass, no arithmetic worth the name). The bytes do not depend
    on oneDNN's layout, so the plain tensors are read (a prepacked weight is opaque to ``view``)."""
    os.environ["SPECGRAFT_PREPACK"] = "0"
    e = engine(args)
    model = e.backend.model
    embed = model.get_input_embeddings().weight
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t is not embed and t.numel() > 4096]
    words = [t.detach().contiguous().view(-1).view(torch.uint8)[: t.numel() * t.element_size() // 4 * 4]
             .view(torch.int32) for t in tensors]
    total = sum(w.numel() * 4 for w in words)

    def read():
        for w in words:
            w.max()

    t = timed(read, args.reps)
    print(f"{total / 1e9:.2f} GB of weights read in {t * 1000:.1f} ms: {total / t / 1e9:.1f} GB/s", file=sys.stderr)
    return {"what": "floor_ms", "backend": "transformers", "dtype": e.dtype, "model": args.model,
            "bytes": total, "ms": round(t * 1000, 1), "gb_s": round(total / t / 1e9, 1)}


def interleaved(arms: dict, ids: list[int], args) -> dict[str, dict[int, float]]:
    """Median ms of one verify of n tokens per arm (``name -> (backend, hidden layers)``), all arms in one
    process, each repetition running every width on every arm with the arms' order rotated; repetition 0 is
    the warm-up."""
    from specgraft.core.tree import Tree

    for be, _ in arms.values():
        be.prefill(torch.tensor(ids))
    times: dict[str, dict[int, list[float]]] = {a: {n: [] for n in args.n} for a in arms}
    names = list(arms)
    for rep in range(args.reps + 1):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for n in args.n:
            tree = Tree.chain(ids[-1], ids[1:n])
            for a in order:
                be, hid = arms[a]
                t = time.perf_counter()
                be.verify(tree, hidden_layers=hid)
                dt = time.perf_counter() - t
                be.truncate(args.prefix)
                if rep:
                    times[a][n].append(dt)
    return {a: {n: round(statistics.median(v) * 1000, 1) for n, v in per.items()} for a, per in times.items()}


def packed_ab(args) -> dict:
    """The transformers step with plain linear layers (bf16 or fp32) against the same weights prepacked for oneDNN
    (``backends/packed.py``), interleaved in one process (both copies held: ~2x the weights' memory)."""
    from specgraft.backends import load_transformers
    from specgraft.backends.packed import prepack
    from specgraft.core.backend import TargetBackend

    os.environ["SPECGRAFT_PREPACK"] = "0"
    plain, tok, _ = load_transformers(args.model, args.dtype, None, "cpu")
    fast = load_transformers(args.model, args.dtype, None, "cpu")[0]
    os.environ["SPECGRAFT_PREPACK"] = "1"
    swapped = len(prepack(fast))
    ids = tok(TEXT).input_ids[: args.prefix]
    arms = {"plain": (TargetBackend(plain), ()), "prepacked": (TargetBackend(fast), ())}
    res = interleaved(arms, ids, args)
    for a, per in res.items():
        print(f"{a:10s} " + " ".join(f"{n}:{ms}" for n, ms in per.items()), file=sys.stderr)
    return {"what": "packed_ab_ms", "model": args.model, "dtype": args.dtype, "prefix": args.prefix,
            "reps": args.reps, "layers_packed": swapped, "ms": res}


def hint_ab(args) -> dict:
    """The same prepacked weights laid out for different row counts (oneDNN's batch-size hint to the reorder,
    ``packed.BATCH_HINT``), interleaved in one process (one copy of the weights per hint)."""
    from specgraft.backends import load_transformers
    from specgraft.backends.packed import prepack
    from specgraft.core.backend import TargetBackend

    os.environ["SPECGRAFT_PREPACK"] = "0"
    arms, swapped = {}, 0
    for hint in args.hints:
        model, tok, _ = load_transformers(args.model, args.dtype, None, "cpu")
        os.environ["SPECGRAFT_PREPACK"] = "1"
        swapped = len(prepack(model, hint))
        os.environ["SPECGRAFT_PREPACK"] = "0"
        if not swapped:
            sys.exit(f"error: no {args.dtype} layer is packed on this CPU: every hint would measure the same layers")
        arms[f"hint {hint}"] = (TargetBackend(model), ())
    os.environ["SPECGRAFT_PREPACK"] = "1"
    res = interleaved(arms, tok(TEXT).input_ids[: args.prefix], args)
    for a, per in res.items():
        print(f"{a:10s} " + " ".join(f"{n}:{ms}" for n, ms in per.items()), file=sys.stderr)
    return {"what": "hint_ab_ms", "model": args.model, "dtype": args.dtype, "prefix": args.prefix,
            "reps": args.reps, "layers_packed": swapped, "ms": res}


def dtype_ab(args) -> dict:
    """What ``--dtype auto`` chooses between: the model in fp32 and in bf16, each as the engine loads it here
    (prepacked where oneDNN packs that dtype on this CPU, plain otherwise), interleaved in one process."""
    from specgraft.backends import load_transformers
    from specgraft.core.backend import TargetBackend, packed_layers
    from specgraft.models import resolve_dtype

    arms, packed = {}, {}
    for dtype in ("float32", "bfloat16"):
        model, tok, _ = load_transformers(args.model, dtype, None, "cpu")
        arms[dtype] = (TargetBackend(model), ())
        packed[dtype] = packed_layers(model)  # what was swapped (0 under SPECGRAFT_PREPACK=0)
    res = interleaved(arms, tok(TEXT).input_ids[: args.prefix], args)
    for a, per in res.items():
        print(f"{a:10s} packed={packed[a]:3d} " + " ".join(f"{n}:{ms}" for n, ms in per.items()), file=sys.stderr)
    return {"what": "dtype_ab_ms", "model": args.model, "prefix": args.prefix, "reps": args.reps,
            "layers_packed": packed, "auto": resolve_dtype("auto"), "ms": res}


def llama_widths(args) -> dict:
    """Verify cost by width on llama.cpp for several contexts measured in one process, interleaved with the
    order rotated each repetition: the GGUF as it is (without and with its hidden-state tap, reading the
    head's layers or not) and its ``gguf-q8`` variant."""
    from specgraft.backends import llamacpp_backend
    from specgraft.registry import shipped_head
    from specgraft.eagle.checkpoint import read_config

    layers = tuple(read_config(shipped_head(args.model))["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    no_tap, tok = llamacpp_backend(args.model, hidden=False)
    tap = llamacpp_backend(args.model)[0]
    variant = llamacpp_backend(args.model, weights="gguf-q8")[0]
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tok)(TEXT).input_ids[: args.prefix]
    arms = {"gguf, no tap": (no_tap, ()), "gguf, tap idle": (tap, ()), "gguf, tap reading": (tap, layers),
            "gguf-q8": (variant, ())}
    res = interleaved(arms, ids, args)
    tap_kind = tap._tap.kind
    print(f"tap: {tap_kind}; layers {layers}", file=sys.stderr)
    for a, per in res.items():
        print(f"{a:20s} " + " ".join(f"{n}:{ms}" for n, ms in per.items()), file=sys.stderr)
    return {"what": "llama_widths_ms", "model": args.model, "prefix": args.prefix, "tap": tap_kind,
            "reps": args.reps, "ms": res}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("verify", "prefill", "memory", "profile", "floor", "llama-widths", "packed-ab",
                                    "dtype-ab", "hint-ab"))
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--backend", default="transformers")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--n", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512, 1024, 2048])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hints", type=int, nargs="+", default=[1, 16], help="hint-ab: the row counts to lay out for")
    p.add_argument("--ubatch", type=int, default=0)
    p.add_argument("--flash-attn", type=int, default=None)
    args = p.parse_args()
    print(json.dumps({"verify": verify, "prefill": prefill, "memory": memory, "profile": profile,
                      "floor": floor, "packed-ab": packed_ab, "dtype-ab": dtype_ab, "hint-ab": hint_ab,
                      "llama-widths": llama_widths}[args.what](args)))


if __name__ == "__main__":
    main()
