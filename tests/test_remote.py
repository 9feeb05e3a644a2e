"""The app's remote client against this project's serve and against broken servers (loopback only)."""
from __future__ import annotations

import socket
import threading

import pytest

from app.core.remote import RemoteClient, RemoteConfig, RemoteError, RemoteFinish, RemotePiece
from engine.types import GenerationRequest, Message
from tests.engine_fixtures import tiny_engine
from tests.serve_fixtures import MODEL, llama_cpp_serving, serving


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return tiny_engine(*tiny_pair)


def test_chat_streams_with_colours_and_counts_from_our_own_server(engine):
    messages = (Message("user", "def add(a, b):"),)
    gen = engine.generate(GenerationRequest(messages=messages, k=3, max_new_tokens=24))
    for _ in gen:
        pass
    with serving(engine, api_key="k") as running:
        client = RemoteClient(RemoteConfig(running.root, api_key="k", model=MODEL))
        assert client.test() == f"connected: {MODEL}"
        events = list(client.stream_chat(messages, max_tokens=24, temperature=0))
        pieces = [e for e in events if isinstance(e, RemotePiece)]
        finish = events[-1]
        assert isinstance(finish, RemoteFinish) and finish.colours and finish.draft_n and finish.completion_tokens
        assert "".join(p.text for p in pieces) == gen.summary.text
        assert {v.status for p in pieces for v in p.tokens} <= {"accepted", "rejected", "corrected", "bonus", "target"}
        metrics = client.read_metrics()
        assert metrics.draft_tokens == finish.draft_n and metrics.accepted == finish.draft_n_accepted
        assert len(metrics.by_position) == 12 and metrics.acceptance is not None
        wrong = RemoteClient(RemoteConfig(running.base_url, api_key="nope"))
        with pytest.raises(RemoteError, match="API key"):
            wrong.test()


@pytest.mark.parametrize("url", ["", "not a url", "http://", "ftp://x", "http://[::1", "\x00", "http://127.0.0.1:99999/v1"])
def test_a_url_that_names_no_server_is_one_line_before_anything_is_sent(url):
    client = RemoteClient(RemoteConfig(url, timeout_s=2))
    for call in (client.test, client.read_metrics,
                 lambda: list(client.stream_chat((Message("user", "hi"),), max_tokens=4, temperature=0.0))):
        with pytest.raises(RemoteError) as e:
            call()
        assert "\n" not in str(e.value) and ("not a server URL" in str(e.value) or "cannot reach" in str(e.value))


def test_nobody_listening_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RemoteClient(RemoteConfig(f"http://127.0.0.1:{port}", timeout_s=5))
    with pytest.raises(RemoteError, match="cannot reach .* is the server running"):
        list(client.stream_chat((Message("user", "hi"),), max_tokens=4, temperature=0))


def _raw_server(reply: bytes | None) -> tuple[socket.socket, threading.Thread]:
    """Accepts one connection, reads the request, sends `reply` (None: nothing) and closes."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)

    def serve() -> None:
        conn, _ = sock.accept()
        with conn:
            conn.recv(65536)
            if reply is None:
                while conn.recv(65536):  # the rest of the request may come later: wait until the client gives up
                    pass
            else:
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return sock, thread


def test_a_server_that_stops_mid_answer_is_one_line():
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    event = b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}]}\n\n'
    sock, thread = _raw_server(head + f"{len(event):x}\r\n".encode() + event + b"\r\n")
    with sock:
        client = RemoteClient(RemoteConfig(f"http://127.0.0.1:{sock.getsockname()[1]}", model="m", timeout_s=5))
        got = []
        with pytest.raises(RemoteError, match="stopped in the middle of the answer"):
            for e in client.stream_chat((Message("user", "hi"),), max_tokens=4, temperature=0):
                got.append(e)
        assert [p.text for p in got] == ["Hel"]  # what arrived is kept
        thread.join(5)


def test_a_server_that_never_answers_times_out_in_one_line():
    sock, thread = _raw_server(None)
    with sock:
        client = RemoteClient(RemoteConfig(f"http://127.0.0.1:{sock.getsockname()[1]}", model="m", timeout_s=0.5))
        with pytest.raises(RemoteError, match="did not answer within"):
            list(client.stream_chat((Message("user", "hi"),), max_tokens=4, temperature=0))
        client.close()
        thread.join(5)


def test_llama_cpp_pythons_own_server_is_a_remote_with_counts_only(tmp_path):
    """A real third-party OpenAI server (llama-cpp-python's) on a tiny GGUF: text streams, no colours, and
    what it does not report (timings, speculative metrics) is None rather than invented."""
    from tests.tiny_gguf import save_gguf_pair

    gguf = save_gguf_pair(tmp_path)[0]
    with llama_cpp_serving(gguf, "tiny") as url:
        client = RemoteClient(RemoteConfig(url, model="tiny"))
        assert client.models() == ["tiny"]
        events = list(client.stream_chat((Message("user", "hello"),), max_tokens=8, temperature=0))
        finish = events[-1]
        assert isinstance(finish, RemoteFinish) and finish.finish_reason in ("stop", "length")
        assert not finish.colours and finish.tokens_per_target_forward is None
        assert all(not p.tokens for p in events[:-1])
