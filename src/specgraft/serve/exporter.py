"""Per-replica Prometheus exporters for Ray Serve (docs/serving.md, Scale-out: Metrics).

Serve's proxy sends ``GET /metrics`` to one replica per request, so scrapes through it jump between replicas.
Each replica therefore also serves its own registry on a port of its own and announces it in Prometheus'
file-based service discovery, as Ray announces its metrics agents: one JSON file per replica in
``$SPECGRAFT_PROM_SD_DIR`` (default ``/tmp/specgraft/prom_sd``), ``[{"targets": ["ip:port"], "labels": {...}}]``.
Point a ``file_sd_configs`` job at ``<dir>/*.json`` and every replica's ``specgraft:`` series arrive labelled by
replica, never mixed. A replica that exits removes its file; one killed with SIGKILL leaves it behind, and
Prometheus marks that target down.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import socket
from pathlib import Path

from prometheus_client import start_http_server

SD_DIR_ENV = "SPECGRAFT_PROM_SD_DIR"
DEFAULT_SD_DIR = "/tmp/specgraft/prom_sd"


def sd_dir() -> Path:
    return Path(os.environ.get(SD_DIR_ENV) or DEFAULT_SD_DIR)


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 -- not in a Ray worker: this host's name
        return socket.gethostname()


class ReplicaExporter:
    """Serves ``registry`` on a free port of this node and writes the service-discovery file for it."""

    def __init__(self, registry, replica: str, deployment: str = "SpecgraftDeployment"):
        ip = _node_ip()
        self.httpd, _ = start_http_server(0, addr=ip, registry=registry)
        self.target = f"{ip}:{self.httpd.server_port}"
        self.path = sd_dir() / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', replica)}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps([{"targets": [self.target],
                                    "labels": {"replica": replica, "deployment": deployment}}]))
        os.replace(tmp, self.path)  # Prometheus never reads a half-written file
        atexit.register(self.close)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self.httpd.shutdown()
