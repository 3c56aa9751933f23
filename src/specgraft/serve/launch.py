"""Start a server from settings: load the engine, resolve ``--method auto``, warm up, start the engine thread.
Shared by ``specgraft serve`` (one uvicorn process) and every Ray Serve replica (ray.py)."""

from __future__ import annotations

import sys
from typing import Optional

from ..auto import choose_method
from ..engine import Engine
from ..errors import SpecgraftError
from ..registry import check_options
from .app import Server


def build_server(model: str, dtype: str, method: str, budget, opts: dict, name: Optional[str], max_num_seqs: int,
                 max_queue: int, timeout: float, max_tokens: int, cache_dir: Optional[str] = None,
                 batch_budget: bool = True, backend: str = "transformers", device: str = "cpu"):
    """Load the engine, resolve ``--method auto``, warm the drafter, start the engine thread."""
    if max_num_seqs < 1 or max_queue < 0 or max_tokens < 1:
        raise SpecgraftError("--max-num-seqs and --max-tokens must be >= 1, --max-queue >= 0")
    if method == "auto" and (opts or budget is not None):
        raise SpecgraftError("--opt / --budget need an explicit --method (auto chooses its own)")
    if method != "auto":
        check_options(method, opts)
    engine = Engine(model, dtype, cache_dir, backend=backend, device=device)
    auto = None
    if method == "auto":
        choice = choose_method(engine)
        method, budget, opts = choice.method, choice.budget, dict(choice.options)
        auto = {"method": method, "budget": budget, "reason": choice.reason}
        print(f"method auto: {choice.describe()} — {choice.reason}", file=sys.stderr)
    return Server.start(engine, name, method, opts, budget, max_num_seqs, max_queue, timeout or None, max_tokens,
                        auto, batch_budget=batch_budget)
