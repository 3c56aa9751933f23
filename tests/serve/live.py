"""A real uvicorn server in a background thread, for tests that talk HTTP (openai client, browsers)."""

from __future__ import annotations

import socket
import threading

import uvicorn

from specgraft.serve.app import Server, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling a test thread when it listens (an event, not a poll)."""

    def __init__(self, config):
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets=None):
        await super().startup(sockets)
        self.ready.set()


class Live:
    """``with Live(server) as url:`` serves ``create_app(server)`` on a free port until the block ends; the
    server is stopped afterwards (``Server.stop``: the engine loop ends, every request still in the engine is
    aborted and the engine's own budget policy is restored)."""

    def __init__(self, server: Server):
        self.server, self.port = server, free_port()
        self.uv = _Uvicorn(uvicorn.Config(create_app(server), host="127.0.0.1", port=self.port,
                                                log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        if not self.uv.ready.wait(60) or not self.uv.started:
            raise RuntimeError("the test server did not start")
        return self.url

    def __exit__(self, *exc) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=10)
        self.server.stop()  # leaves the shared engine clean for other tests (no server's policy left behind)
