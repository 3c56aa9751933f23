"""Start a server from settings: load the engine, resolve ``--method auto``, warm up, start the engine thread.
Shared by ``specgraft serve`` (one uvicorn process) and every Ray Serve replica (ray.py)."""

from __future__ import annotations

import os
import sys
from typing import Optional

from ..auto import choose_method
from ..engine import Engine
from ..errors import SpecgraftError
from ..models import resolve_device, resolve_dtype
from ..registry import check_options
from .app import MAX_BODY_BYTES, Server
from .options import DEFAULT_MAX_BUDGET, ClientPolicy


# PyTorch's CPU matmuls (oneDNN, through ideep) keep a compiled kernel per matmul shape in two caches of 1,024
# entries each (ideep's LRU_CACHE_CAPACITY, oneDNN's ONEDNN_PRIMITIVE_CACHE_CAPACITY). A server meets new shapes
# all the time (rows x tree width x cached length in attention), so its resident memory grew by ~280 MB over 400
# soak requests until those caches filled; 8 entries each keep the shapes that recur within a step, and the soak
# ran no slower (docs/serving.md, "Memory under a soak"). A value the user set wins.
KERNEL_CACHES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
KERNEL_CACHE_ENTRIES = 8


def bound_kernel_caches(environ=os.environ) -> dict[str, str]:
    """Cap the CPU kernel caches for this process unless the user chose a size; must run before the process's
    first CPU matmul (each library reads its variable once). Returns the capacities in effect."""
    return {name: environ.setdefault(name, str(KERNEL_CACHE_ENTRIES)) for name in KERNEL_CACHES}


def build_server(model: str, dtype: str, method: str, budget, opts: dict, name: Optional[str], max_num_seqs: int,
                 max_queue: int, timeout: float, max_tokens: int, cache_dir: Optional[str] = None,
                 batch_budget: bool = True, backend: str = "transformers", device: str = "cpu",
                 methods: Optional[str] = None, max_budget: int = DEFAULT_MAX_BUDGET,
                 client_options: Optional[str] = None, api_key: Optional[str] = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
    """Load the engine, resolve ``--method auto``, build the allowed methods' drafters, start the engine thread.
    ``methods`` / ``max_budget`` / ``client_options``: what clients may choose (serve/options.py)."""
    if max_num_seqs < 1 or max_queue < 0 or max_tokens < 1 or max_body_bytes < 1:
        raise SpecgraftError("--max-num-seqs, --max-tokens and --max-body-bytes must be >= 1, --max-queue >= 0")
    policy = ClientPolicy.parse(methods, max_budget, client_options)  # bad flags fail before the model loads
    if method == "auto" and (opts or budget is not None):
        raise SpecgraftError("--opt / --budget need an explicit --method (auto chooses its own)")
    if method != "auto":
        check_options(method, opts)
    bound_kernel_caches()
    # A server's steps are batches: --dtype auto is the wide-step dtype even under --backend auto (whose scoring
    # of both dense dtypes is for one request at a time)
    engine = Engine(model, resolve_dtype(dtype, resolve_device(device)), cache_dir, backend=backend, device=device)
    if engine.backend_choice is not None:
        print(f"backend auto: {engine.backend_choice.describe()} — {engine.backend_choice.reason}", file=sys.stderr)
    auto = None
    if method == "auto":
        choice = choose_method(engine)
        method, budget, opts = choice.method, choice.budget, dict(choice.options)
        auto = {"method": method, "budget": budget, "reason": choice.reason}
        print(f"method auto: {choice.describe()} — {choice.reason}", file=sys.stderr)
    return Server.start(engine, name, method, opts, budget, max_num_seqs, max_queue, timeout or None, max_tokens,
                        auto, batch_budget=batch_budget, policy=policy, api_key=api_key, max_body_bytes=max_body_bytes)
