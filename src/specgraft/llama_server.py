"""llama.cpp's own server with its own speculation, as an outside reference (``--method llama_server``).

``llama-server`` is built from the llama.cpp that llama-cpp-python vendors (``scripts/build_llama_server.sh``;
the binary is found through ``SPECGRAFT_LLAMA_SERVER`` or the script's default place) and started once per
setting on the engine's GGUF with the backend's threads, one slot, no prompt cache, on a free local port. Each
prompt is sent as token ids to ``/completion`` (greedy, or the request's sampling settings); the reply's token
ids and llama-server's own ``timings`` (its draft and accepted counts) fill the record. Its speculation:

    spec  none            llama.cpp AR through the server (what its users run without speculation)
          ngram-mod       llama-server's n-gram speculation (``--spec-type ngram-mod``)
          ngram-simple    ``--spec-type ngram-simple``
          ngram-map-k     ``--spec-type ngram-map-k``
          draft-simple    a draft model (``draft_model``: a registry name or a .gguf) through ``-md``
    args                  further llama-server flags (e.g. ``--spec-draft-n-max 4``), split like a shell line

It is a benchmark reference, never served (the server's methods exclude the outside references).
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .core.sampling import SamplingParams
from .core.stats import Stats
from .errors import SpecgraftError

SPECS = ("none", "ngram-mod", "ngram-simple", "ngram-map-k", "draft-simple")
START_TIMEOUT_S = 300  # loading a 1.5B GGUF on two cores
_SERVERS: dict[tuple, "Server"] = {}


def binary() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specgraft" / "llama-server" / "llama-server"
    path = Path(os.environ.get("SPECGRAFT_LLAMA_SERVER", default))
    if not path.is_file():
        raise SpecgraftError(f"llama_server needs llama.cpp's server binary at {path}: build it with "
                             "scripts/build_llama_server.sh (or set SPECGRAFT_LLAMA_SERVER)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server process; its log goes to a temporary file (named in every error)."""

    def __init__(self, argv: list[str]):
        self.port = _free_port()
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="llama-server-", suffix=".log", delete=False)
        self.http = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
        try:
            self.proc = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", str(self.port)],
                                         stdout=self.log, stderr=subprocess.STDOUT)
        except OSError as err:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
            raise SpecgraftError(f"cannot start llama-server {argv[0]}: {err}") from err
        try:
            self._wait_ready()
        except BaseException:  # an error, a timeout or Ctrl-C: no orphaned server
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # readiness: /health answers 200 once the model is loaded
            if self.proc.poll() is not None:
                raise SpecgraftError(f"llama-server exited with status {self.proc.returncode} at start "
                                     f"({self.tail()}); log: {self.log.name}")
            try:
                with self.http.open(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise SpecgraftError(f"llama-server did not become ready in {START_TIMEOUT_S} s; log: {self.log.name}")
            time.sleep(0.2)  # the poll interval while the model loads

    def tail(self) -> str:
        if not self.log.closed:
            self.log.flush()
        lines = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def complete(self, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with self.http.open(req, timeout=3600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            raise SpecgraftError(f"llama-server refused the request: {err.read().decode(errors='replace')[:300]}") from err
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as err:
            raise ServerDied(f"llama-server failed ({err}; {self.tail()}); log: {self.log.name}") from err

    def close(self, remove_log: bool = False) -> None:
        """Stop the server; its log stays (errors name it) unless ``remove_log``."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.log.close()
        if remove_log:
            Path(self.log.name).unlink(missing_ok=True)


class ServerDied(SpecgraftError):
    """The server stopped answering: it is dropped, and the next request starts a new one."""


@atexit.register
def _close_all() -> None:
    for s in _SERVERS.values():
        s.close(remove_log=True)
    _SERVERS.clear()


def server_argv(engine, spec: str, draft_model: str, args: str) -> list[str]:
    if spec not in SPECS:
        raise SpecgraftError(f"llama_server: unknown spec '{spec}'; choose one of: {', '.join(SPECS)}")
    if (spec == "draft-simple") != bool(draft_model):
        raise SpecgraftError("llama_server: spec=draft-simple takes draft_model=NAME (and only it does)")
    be = engine.backend
    s = be.settings
    threads = str(s.n_threads or os.cpu_count() or 1)
    argv = [str(binary()), "-m", str(be.model.path), "-t", threads, "-tb", threads, "-c", str(be.max_positions),
            "-np", "1",
            "-b", str(s.n_batch), "-ub", str(s.n_ubatch), "--no-cache-prompt", "--no-warmup",
            "-fa", {-1: "auto", 0: "off", 1: "on"}[s.flash_attn]]
    if spec == "draft-simple":
        from .models import gguf_file

        argv += ["-md", str(gguf_file(draft_model)[0]), "--spec-type", "draft-simple"]
    elif spec != "none":
        argv += ["--spec-type", spec]
    return argv + shlex.split(args)


def llama_server(engine, ids: list[int], sampling: SamplingParams, max_new_tokens: int, spec: str,
                 draft_model: str, args: str):
    """Generate with llama-server's own loop; returns ``(token_ids, Stats)``. MAT = new tokens / (new tokens -
    accepted drafted tokens), llama-server's own counts."""
    if "llama_server" not in engine.capabilities.references:
        raise SpecgraftError("llama_server runs llama.cpp's own server on the GGUF: use --backend llamacpp")
    argv = server_argv(engine, spec, draft_model, args)
    if len(ids) + max_new_tokens > engine.backend.max_positions:  # llama-server would stop early, silently
        raise SpecgraftError(f"llama_server: {len(ids)} prompt + {max_new_tokens} new tokens exceed its context of "
                             f"{engine.backend.max_positions}")
    key = tuple(argv)
    if key not in _SERVERS:
        _SERVERS[key] = Server(argv)
    body = {"prompt": ids, "n_predict": max_new_tokens, "cache_prompt": False, "return_tokens": True,
            "stream": False, "temperature": 0.0 if sampling.greedy else sampling.temperature}
    if not sampling.greedy:
        if sampling.eta:
            raise SpecgraftError("llama_server: llama.cpp has no eta sampling")
        # our order (core.sampling.target_probs): temperature, then top-k, top-p, min-p (llama.cpp's default
        # order applies temperature last, which changes what top-p and min-p keep)
        body.update(top_k=sampling.top_k or 0, top_p=sampling.top_p, min_p=sampling.min_p, typical_p=1.0,
                    repeat_penalty=1.0, seed=sampling.seed if sampling.seed is not None else -1,
                    samplers=["temperature", "top_k", "top_p", "min_p"])
    else:
        body.update(top_k=1)
    t0 = time.perf_counter()
    try:
        reply = _SERVERS[key].complete(body)
    except ServerDied:
        _SERVERS.pop(key).close()
        raise
    stats = Stats(method="llama_server")
    stats.total_s = time.perf_counter() - t0
    new = [int(t) for t in reply.get("tokens", [])]  # the end token included, as in our loops
    timings = reply.get("timings", {})
    accepted = int(timings.get("draft_n_accepted", 0) or 0)
    stats.new_tokens = len(new)
    steps = max(1, len(new) - accepted)
    stats.steps = steps
    stats.committed = [len(new) // steps + (i < len(new) % steps) for i in range(steps)] if new else []
    # llama-server's own timings: its prompt processing and its generation loop (drafting included)
    stats.prefill_s = float(timings.get("prompt_ms", 0.0)) / 1000
    stats.verify_s = float(timings.get("predicted_ms", 0.0)) / 1000
    stats.tree_nodes = int(timings.get("draft_n", 0) or 0)
    return new, stats
