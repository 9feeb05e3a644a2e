"""An OpenAI-compatible server over a tiny engine, run in-process on a free loopback port."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from app.serve.api import ServeConfig, create_app
from app.serve.protocol import Defaults
from engine.serving.scheduler import Scheduler

MODEL = "tiny-target"


@dataclass
class Running:
    base_url: str  # http://127.0.0.1:PORT/v1
    root: str  # http://127.0.0.1:PORT
    scheduler: Scheduler


@contextlib.contextmanager
def serving(engine, *, max_seqs: int = 4, queue: int = 16, api_key: str | None = None,
            defaults: Defaults | None = None) -> Iterator[Running]:
    scheduler = Scheduler(engine, max_seqs=max_seqs, queue_size=queue)
    app = create_app(scheduler, ServeConfig(model=MODEL, defaults=defaults or Defaults(k=3, max_tokens=32),
                                            api_key=api_key))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield Running(f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{port}", scheduler)
    finally:
        server.should_exit = True
        thread.join(10)
        scheduler.close()
        sock.close()


def wait_until(condition, timeout: float = 20.0) -> None:
    """Polls a condition the server reaches on its own threads (bounded: fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.02)
