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
from engine.runners.batched import BatchedDecoder
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


class Slow:
    """Slows every target forward, so a generation is still running when the test acts on it."""

    def __init__(self, engine, seconds: float, gate: threading.Event | None = None) -> None:
        """gate: every forward waits until it is set (bounded), then sleeps `seconds`. Both the
        single-sequence runner and the batched decoder are slowed."""
        self.runner, self.seconds, self.gate = engine.target_runner, seconds, gate
        self.forward, self.batched = self.runner.forward, BatchedDecoder.forward

    def _wait(self) -> None:
        if self.gate is not None:
            assert self.gate.wait(60.0), "the test never opened the gate"
        time.sleep(self.seconds)

    def __enter__(self):
        def slow(*args, **kwargs):
            self._wait()
            return self.forward(*args, **kwargs)

        def slow_batch(decoder, parts, logits=True):
            if logits:
                self._wait()
            return self.batched(decoder, parts, logits)

        self.runner.forward = slow
        BatchedDecoder.forward = slow_batch
        return self

    def __exit__(self, *exc):
        del self.runner.forward
        BatchedDecoder.forward = self.batched


@contextlib.contextmanager
def llama_cpp_serving(gguf, alias: str = "tiny") -> Iterator[str]:
    """llama-cpp-python's own OpenAI-compatible server (a real third-party remote) on a free loopback port;
    yields its base URL (…/v1). Skips the test when llama-cpp-python's server extra is not installed."""
    import pytest

    server_app = pytest.importorskip("llama_cpp.server.app")
    settings_mod = pytest.importorskip("llama_cpp.server.settings")
    app = server_app.create_app(
        server_settings=settings_mod.ServerSettings(host="127.0.0.1", port=0),
        model_settings=[settings_mod.ModelSettings(model=str(gguf), model_alias=alias, n_ctx=256, verbose=False,
                                                   n_threads=1, chat_format="chatml")])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "llama-cpp-python's server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
