"""The target's measured verification cost: seconds per forward by tree width, per machine, cached.

Every budget decision reads this one curve: ``--budget auto`` and ``--method auto`` (``auto.py``) and the
server's budget under load (``serve/policy.py``). It is measured through the Backend protocol (a chain of ``W``
tokens after a 256-token prefix, each width timed between two 1-token forwards, 3 sweeps: ``measure_curve``)
and cached under a key naming what it depends on: the model, the backend's weights format, this CPU, the
backend's runtime (threads, library version) and its device (``Backend.capabilities``). Nothing here is
hard-coded per machine.

A curve measured while other processes (or the hypervisor, as steal time) take a share of the CPUs prices every
width too high, and a cached curve is believed until it is deleted: such a measurement is used for the run that
made it and not cached (``CONTENTION_MAX``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from .core.backend import torch_runtime
from .core.tree import Tree
from .env import amx_state, cpu_id, cpu_name
from .errors import SpecgraftError
from .models import cache_root

# every width a tree can have (Graft and EAGLE verify up to 60): costs step where kernels change blocking (llama.cpp's
# x86 GEMM runs on blocks of 4 rows, PyTorch's int4 kernel at 4 and 8), so a budget must land on a measured width,
# not an interpolated one. Beyond 64 the curve is extrapolated.
WIDTHS = tuple(range(1, 65))
# the most of the machine's CPU time (all cores) others may use while a curve is measured for it to be cached:
# on 2 cores one busy neighbour thread is 50%; a few per cent is ordinary background
CONTENTION_MAX = 0.10
# how ``measure_curve`` times the widths; a cached curve timed another way (one width after another, before
# 2026-12-07) is measured again
MEASUREMENT = "paired-reference"


def machine_key(model: str, weights: str, device: str = "cpu", runtime: str | None = None) -> str:
    """Where a measured curve is valid: model, weights format (gguf: the llama.cpp backend), machine, runtime,
    device."""
    raw = f"{model}|{weights}|{cpu_name()}|{runtime or torch_runtime()}"
    if cpu_id():  # "AMD EPYC" names an AVX2-only Milan and an AVX-512 Zen 5 alike: their curves differ
        raw += f"|cpu={cpu_id()}"
    if amx_state() == "usable":  # the same CPU name with and without usable AMX has different curves
        raw += "|amx"
    if device != "cpu":
        raw += f"|device={device}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in raw)[:200]


def file_stamp(path) -> list[int] | None:
    """What a cached decision records of a file it depends on (size, mtime), None when absent."""
    return [path.stat().st_size, path.stat().st_mtime_ns] if path.exists() else None


def write_json(path, body: dict) -> None:
    """Write a cache file whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)


def backend_key(model: str, capabilities) -> str:
    """The cache key of a backend's curve for ``model`` (what it declares: weights, device, runtime)."""
    return machine_key(model, capabilities.weights, capabilities.device, capabilities.runtime)


def engine_key(engine) -> str:
    return backend_key(engine.model_name, engine.capabilities)


def backend_curve_path(model: str, capabilities):
    return cache_root() / "latency" / f"{backend_key(model, capabilities)}.json"


def curve_path(engine):
    return backend_curve_path(engine.model_name, engine.capabilities)


def measure_curve(backend, vocab_size: int, widths=WIDTHS, prefix: int = 256, reps: int = 3,
                  reference: int = 1) -> dict[int, float]:
    """Seconds per verification forward by slot count on an idle backend (random tokens: the cost does not
    depend on them).

    Our machines' speed drifts by tens of per cent within minutes. Timed one after another, a slow phase lands
    on a run of neighbouring widths and the policy reads it as a knee (a SmolLM2 curve measured 46 ms at 1 slot,
    64-73 ms at 2-11 and 37-48 ms at 12-22). So each width is timed between two forwards at the ``reference``
    width, in ``reps`` sweeps over all widths: the curve's shape is each width's median ratio to its two
    neighbours (which ran at the same machine speed), its level the reference's median over the whole
    measurement. A drift then moves the whole curve, not a stretch of it."""
    if backend.rows:
        raise SpecgraftError("the latency curve is measured on an idle engine (requests are in flight)")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, min(vocab_size, 20000), (prefix + max(*widths, reference),), generator=gen)
    backend.prefill(ids[:prefix])

    def timed(w: int) -> float:
        tree = Tree.chain(int(ids[prefix]), ids[prefix + 1: prefix + w].tolist())
        start = time.perf_counter()
        backend.verify(tree)
        seconds = time.perf_counter() - start
        backend.truncate(prefix)
        return seconds

    timed(reference)  # warm-up
    refs: list[float] = []
    ratios: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(reps):
        before = timed(reference)
        refs.append(before)
        for w in widths:
            seconds, after = timed(w), timed(reference)
            ratios[w].append(2 * seconds / (before + after))
            refs.append(after)
            before = after
    backend.reset()
    level = statistics.median(refs)
    return {w: level * statistics.median(ratios[w]) for w in widths}


def cpu_snapshot(stat: Path = Path("/proc/stat"), cpus: set[int] | None = None):
    """(wall s, CPU s the cores this process may run on were busy, steal included, CPU s of this process and all
    its threads, number of those cores); None where the kernel does not publish ``/proc/stat``. Only the cores
    of this process's affinity count: a neighbour pinned elsewhere does not slow a measurement."""
    cpus = cpus if cpus is not None else (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None)
    busy, seen = 0, 0
    try:
        for line in stat.read_text().splitlines():
            name, *values = line.split()
            if not name.startswith("cpu") or name == "cpu" or (cpus is not None and int(name[3:]) not in cpus):
                continue
            # user nice system idle iowait irq softirq steal (guest time is already inside user)
            fields = [int(v) for v in values[:8]]
            busy, seen = busy + sum(fields) - fields[3] - fields[4], seen + 1
    except (OSError, ValueError, IndexError):
        return None
    if not seen:
        return None
    own = os.times()
    return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, seen


def others_share(before, after) -> float | None:
    """The share of the measured cores' time that other processes (and steal) took between two snapshots."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    others = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, others / ((after[0] - before[0]) * after[3]))


_UNCACHED: dict[str, dict[int, float]] = {}  # curves measured under contention: kept for this process only


def backend_curve(model: str, backend, widths=WIDTHS, prefix: int = 256, reps: int = 3,
                  refresh: bool = False) -> dict[int, float]:
    """A backend's curve for ``model``: read from this machine's cache, else measured once and cached (not cached
    when others used more than ``CONTENTION_MAX`` of the CPUs meanwhile: it is then measured again next run)."""
    path = backend_curve_path(model, backend.capabilities)
    cached = json.loads(path.read_text()) if path.exists() and not refresh else {}
    if cached.get("measurement") == MEASUREMENT:
        return {int(k): v for k, v in cached["seconds"].items()}
    if str(path) in _UNCACHED and not refresh:  # one measurement per process: every reader sees the same curve
        return _UNCACHED[str(path)]
    before = cpu_snapshot()
    out = measure_curve(backend, backend.vocab_size, widths, prefix, reps)
    share = others_share(before, cpu_snapshot())
    if share is not None and share > CONTENTION_MAX:
        print(f"warning: other processes used {share:.0%} of this machine's CPU time while the cost curve of "
              f"{model} was measured; this run uses it, but it is not cached (measure on an idle machine)",
              file=sys.stderr)
        _UNCACHED[str(path)] = out
        return out
    _UNCACHED.pop(str(path), None)
    write_json(path, {"key": backend_key(model, backend.capabilities), "prefix": prefix, "seconds": out,
                      "measurement": MEASUREMENT,
                      "others_cpu_share": None if share is None else round(share, 4)})
    return out


def latency_curve(engine, widths=WIDTHS, prefix: int = 256, reps: int = 3, refresh: bool = False) -> dict[int, float]:
    """The engine's curve: read from this machine's cache, else measured once and cached."""
    return backend_curve(engine.model_name, engine.backend, widths, prefix, reps, refresh)


def curve_cost(curve: dict[int, float]):
    """``cost(width)`` in seconds from a curve: a dict lookup at a measured width (every width 1..64 is; it runs
    on a step's path), interpolated off it."""
    def cost(width: int) -> float:
        return curve[width] if width in curve else interpolate(curve, width)
    return cost


def interpolate(curve: dict[int, float], w: int) -> float:
    xs = sorted(curve)
    if w <= xs[0]:
        return curve[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if w <= b:
            return curve[a] + (curve[b] - curve[a]) * (w - a) / (b - a)
    a, b = xs[-2], xs[-1]  # extrapolate linearly beyond the last measurement
    return curve[b] + (curve[b] - curve[a]) * (w - b) / (b - a)
