"""A real uvicorn server in a background thread, for tests that talk HTTP (openai client, browsers)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from specgraft.serve.app import Server, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """``with Live(server) as url:`` serves ``create_app(server)`` on a free port until the block ends; the
    engine thread is stopped and every request still in the engine aborted afterwards."""

    def __init__(self, server: Server):
        self.server, self.port = server, free_port()
        self.uv = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=self.port,
                                                log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        for _ in range(200):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the test server did not start")

    def __exit__(self, *exc) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=10)
        self.server.runner.stop()
        engine = self.server.engine
        for r in list(engine.active):  # leave the shared engine clean for other tests
            engine.abort(r.id)
        engine.step()
