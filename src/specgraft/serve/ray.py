"""The same OpenAI-compatible app on Ray Serve: N replicas, each with its own engine thread (docs/serving.md).

    specgraft serve --replicas 2 --num-cpus 1                      # CLI: run_ray below
    from specgraft.serve.ray import deployment                     # Python
    serve.run(deployment({"model": "smollm2-135m", "method": "graft"}, replicas=2))
    serve run specgraft.serve.ray:app_builder model=smollm2-135m replicas=2   # Ray's CLI / a config file

Every replica is one Ray actor (one process) that calls :func:`~specgraft.serve.launch.build_server` in its constructor
and registers the result with :func:`~specgraft.serve.app.set_server`; the routes are the ones ``create_app()``
builds for uvicorn (Serve wraps a copy of that app in each replica, so the routes find the replica's server through
``set_server``, not ``app.state``). Each replica therefore owns its model, its engine thread, its request queue and
its prometheus registry; responses name the replica that served them (``X-Specgraft-Replica``).

The module is ``specgraft.serve.ray``: ``import ray`` below is absolute (Python 3) and means the ``ray`` package.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from typing import Any

from ..errors import SpecgraftError
from .app import create_app, set_server

try:
    import ray
    from ray import serve
except ImportError:  # the optional extra is not installed: run_ray / deployment say how to get it
    ray = serve = None

APP_NAME = "specgraft"
INSTALL = "Ray Serve is not installed; pip install 'specgraft[ray]'"

# Defaults of `specgraft serve` for build_server's keyword parameters that have none in its signature (a config may
# name only some keys; the accepted keys are exactly build_server's parameters, read from its signature).
CONFIG_DEFAULTS: dict[str, Any] = dict(model="smollm2-135m", dtype="auto", method="auto", budget=None, opts={},
                                       name=None, max_num_seqs=8, max_queue=128, timeout=600.0, max_tokens=256)


def config_defaults() -> dict[str, Any]:
    """build_server's keywords with their defaults (the signature's, else CONFIG_DEFAULTS')."""
    import inspect

    from .launch import build_server

    out = {}
    for name, param in inspect.signature(build_server).parameters.items():
        out[name] = param.default if param.default is not inspect.Parameter.empty else CONFIG_DEFAULTS.get(name)
    return out


def _require() -> None:
    if serve is None:
        raise SpecgraftError(INSTALL)


def _config(config: dict) -> dict:
    """The full build_server keyword set; unknown keys and bad sizes fail here, in the driver, not in a replica."""
    defaults = config_defaults()
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise SpecgraftError(f"unknown deployment config key(s) {', '.join(unknown)}; "
                             f"expected {', '.join(defaults)}")
    cfg = {**defaults, **config}
    cfg["opts"] = dict(cfg["opts"] or {})
    if cfg["max_num_seqs"] < 1 or cfg["max_queue"] < 0 or cfg["max_tokens"] < 1:
        raise SpecgraftError("--max-num-seqs and --max-tokens must be >= 1, --max-queue >= 0")
    if cfg["method"] != "auto":
        from ..registry import check_options

        check_options(cfg["method"], cfg["opts"])
    return cfg


if serve is not None:
    app = create_app()  # no server: each replica registers its own with set_server()

    @serve.deployment(name="SpecgraftDeployment")
    @serve.ingress(app)
    class SpecgraftDeployment:
        """One replica: a model, an engine thread, a metrics registry (``config``: build_server's keywords)."""

        def __init__(self, config: dict):
            from .launch import build_server

            from .exporter import ReplicaExporter

            self.server = build_server(**config)
            set_server(self.server)
            # this replica's own registry on its own port, announced for Prometheus (exporter.py): scrapes
            # through the proxy answer from one replica per request
            self.exporter = ReplicaExporter(self.server.metrics.registry, self.server.replica)
            import torch

            print(f"specgraft replica {self.server.replica}: {self.server.name} ({self.server.method}), "
                  f"{torch.get_num_threads()} torch thread(s)", file=sys.stderr)

        def check_health(self) -> None:
            """Serve's periodic health check: a replica whose engine loop died is replaced."""
            if not self.server.runner.alive:
                raise RuntimeError(f"engine loop stopped: {self.server.runner.error}")

        def __del__(self):
            server = getattr(self, "server", None)
            if server is not None:
                server.stop()
            exporter = getattr(self, "exporter", None)
            if exporter is not None:
                exporter.close()
else:
    app = SpecgraftDeployment = None


def deployment(config: dict, replicas: int = 2, num_cpus: float = 1.0, max_replicas: int = 0):
    """A bound Serve application: ``replicas`` replicas (autoscaled up to ``max_replicas`` when that is larger),
    each reserving ``num_cpus`` CPUs; ``config`` holds build_server's keywords (missing ones: the CLI defaults).

    Serve sends a replica at most ``max_num_seqs + max_queue`` requests at once (beyond that they wait in Serve's
    proxy), so the replica's own queue and its 429 work as in the single-process server. The autoscaler aims at
    ``max_num_seqs`` requests in flight per replica (a full batch)."""
    _require()
    cfg = _config(config)
    if replicas < 1:
        raise SpecgraftError(f"--replicas must be >= 1, got {replicas}")
    if num_cpus < 0:
        raise SpecgraftError(f"--num-cpus must be >= 0, got {num_cpus}")
    if max_replicas and max_replicas < replicas:
        raise SpecgraftError(f"--max-replicas ({max_replicas}) must be 0 (no autoscaling) or >= --replicas "
                             f"({replicas})")
    options: dict[str, Any] = dict(ray_actor_options={"num_cpus": num_cpus},
                                   max_ongoing_requests=cfg["max_num_seqs"] + cfg["max_queue"])
    if max_replicas > replicas:
        options["autoscaling_config"] = {"min_replicas": replicas, "initial_replicas": replicas,
                                         "max_replicas": max_replicas, "target_ongoing_requests": cfg["max_num_seqs"]}
    else:
        options["num_replicas"] = replicas
    return SpecgraftDeployment.options(**options).bind(cfg)


def _none(v):
    return None if v in (None, "", "none", "None", "null") else v


def _bool(v) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {v!r}")


def app_builder(args: dict):
    """Ray's application builder: ``serve run specgraft.serve.ray:app_builder model=smollm2-135m replicas=2`` or a
    Serve config file's ``import_path`` with ``args``. Values may be strings (``serve run``) or typed (YAML); each
    is converted to the type of build_server's default; ``opts`` is a mapping or ``"k=v,k2=v2"``; ``replicas``,
    ``num_cpus`` and ``max_replicas`` size the deployment (defaults 2, 1.0, 0)."""
    from ..eval.harness import parse_budget, parse_opts

    args = dict(args or {})
    defaults = config_defaults()
    try:
        replicas = int(args.pop("replicas", 2))
        num_cpus = float(args.pop("num_cpus", 1.0))
        max_replicas = int(args.pop("max_replicas", 0))
        cfg: dict[str, Any] = {}
        for key, value in args.items():
            default = defaults.get(key)
            if key == "budget":
                value = parse_budget(_none(None if value is None else str(value)))
            elif key == "opts":
                value = parse_opts([o for o in value.split(",") if o.strip()]) if isinstance(value, str) else value
            elif isinstance(default, bool):
                value = _bool(value)
            elif isinstance(default, int):
                value = int(value)
            elif isinstance(default, float):
                value = float(value)
            elif default is None:
                value = _none(value)
            cfg[key] = value
    except (TypeError, ValueError) as err:
        raise SpecgraftError(f"bad application argument: {err}") from None
    return deployment(cfg, replicas, num_cpus, max_replicas)


def _failure(err: Exception) -> str:
    """The replica's own error, from the deployment status (Serve's exception only says that it failed)."""
    text = str(err)
    try:
        status = serve.status().applications[APP_NAME]
        text = next((d.message for d in status.deployments.values() if d.message), status.message) or text
    except Exception:  # noqa: BLE001 -- keep Serve's message
        pass
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return re.sub(r"^(specgraft\.errors\.)?SpecgraftError: ", "", lines[-1] if lines else text)


def run_ray(config: dict, replicas: int, num_cpus: float, max_replicas: int, host: str, port: int) -> None:
    """``specgraft serve --replicas N``: deploy on Ray Serve and block until Ctrl-C (or SIGTERM).

    ``ray.init()`` joins the cluster named by RAY_ADDRESS (or one started with ``ray start`` on this machine) and
    otherwise starts a local one. On exit the application is deleted and this process leaves Ray (a local cluster
    it started stops with it; a shared cluster keeps running)."""
    _require()
    target = deployment(config, replicas, num_cpus, max_replicas)  # config errors before Ray starts

    def _term(signum, frame):
        raise KeyboardInterrupt

    previous, joined = signal.getsignal(signal.SIGTERM), not ray.is_initialized()
    try:
        if joined:
            ray.init()
        signal.signal(signal.SIGTERM, _term)  # after ray.init, which installs its own (sys.exit) for drivers
        serve.start(http_options={"host": host, "port": port})
        n = f"{replicas}-{max_replicas}" if max_replicas > replicas else str(replicas)
        print(f"starting {n} replica(s) of {config.get('model')} on Ray Serve ...", file=sys.stderr)
        try:
            serve.run(target, name=APP_NAME, route_prefix="/")
        except RuntimeError as err:  # a replica's constructor raised (bad model, bad options): say it in one line
            raise SpecgraftError(f"the deployment failed: {_failure(err)}") from None
        print(f"serving on http://{host}:{port}  ({n} replica(s); playground: /, metrics: /metrics of one replica "
              f"per request)  Ctrl-C to stop", file=sys.stderr)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("shutting down ...", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if ray.is_initialized():
            try:
                serve.delete(APP_NAME)
            except Exception:  # noqa: BLE001 -- the cluster may already be going away
                pass
            if joined:  # leave a Ray that our caller initialised to our caller
                ray.shutdown()
