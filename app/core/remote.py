"""The app as a client of a remote OpenAI-compatible server (this project's `serve`, vLLM, llama-server, ...).

Qt-free: the chat streams through `RemoteClient.stream_chat`, which yields `RemotePiece`s (text, and
token statuses when the server is this project's own) and ends with one `RemoteFinish` (llama-server's
`timings` draft counts where the server reports them). `read_metrics` reads aggregate acceptance and
acceptance by draft position from `/metrics` in vLLM's schema. Every failure is a RemoteError with one
line a person can act on: the server cannot be reached, it timed out, it stopped mid-answer, it refused.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.types import Message, TokenView

STATUSES = ("accepted", "rejected", "corrected", "bonus", "target")
SOURCES = ("draft", "ngram", "head")  # engine.types.DraftSource


class RemoteError(Exception):
    """A remote server could not answer; the message is one line for the status bar."""


@dataclass(frozen=True)
class RemoteConfig:
    """Where the server is and how to ask it (the Models dialog's "Remote server" fields)."""

    url: str  # base URL, e.g. http://127.0.0.1:8000/v1 (a URL without /v1 gets it added)
    api_key: str = field(default="", repr=False)  # sent as a bearer token when not empty; never logged
    model: str = ""  # model name; "" asks /v1/models and takes the first
    timeout_s: float = 60.0  # connect and between-bytes timeout

    @property
    def base(self) -> str:
        url = self.url.strip().rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    @property
    def root(self) -> str:
        return self.base[: -len("/v1")]


@dataclass(frozen=True)
class RemotePiece:
    """Text streamed by the server, with how each token came to be when the server says (this project's)."""

    text: str  # text to append to the answer
    tokens: tuple[TokenView, ...] = ()  # statuses, q and p (empty: the server does not report them)
    tree_width: int = 0  # draft tokens the step verified as a tree (0: a chain, a standard step, another server)
    tree_depth: int = 0  # the tree's levels (0 likewise)


@dataclass(frozen=True)
class RemoteFinish:
    """How the answer ended and what the server reported about it."""

    finish_reason: str  # "stop", "length", or "cancelled" (stopped by the person)
    completion_tokens: int | None  # from usage, when sent
    draft_n: int | None  # llama-server's timings.draft_n (None: not reported)
    draft_n_accepted: int | None  # timings.draft_n_accepted
    tokens_per_target_forward: float | None  # this project's servers only
    colours: bool  # the stream carried token statuses


@dataclass(frozen=True)
class RemoteMetrics:
    """Aggregates from /metrics in vLLM's schema (None where the server does not export them)."""

    drafts: float | None  # vllm:spec_decode_num_drafts
    draft_tokens: float | None  # vllm:spec_decode_num_draft_tokens
    accepted: float | None  # vllm:spec_decode_num_accepted_tokens
    by_position: tuple[float, ...]  # acceptance at each draft position: accepted_per_pos / drafts

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens and self.accepted is not None else None


class RemoteClient:
    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(config.timeout_s))

    def close(self) -> None:
        self.http.close()

    def models(self) -> list[str]:
        """The models the server offers (the Test button): raises RemoteError with one line."""
        data = self._json(self._call("GET", f"{self.config.base}/models"))
        return [m.get("id", "") for m in data.get("data", []) if isinstance(m, dict)]

    def test(self) -> str:
        """One line for the Models dialog: what the server offers, or what is wrong."""
        names = self.models()
        if self.config.model and self.config.model not in names:
            return f"connected, but the server has no model '{self.config.model}' (it has: {', '.join(names)})"
        return f"connected: {', '.join(names) or 'no models listed'}"

    def stream_chat(self, messages: tuple[Message, ...], *, max_tokens: int, temperature: float, top_p: float = 1.0,
                    seed: int | None = None, cancel: threading.Event | None = None
                    ) -> Iterator[RemotePiece | RemoteFinish]:
        """Streams one answer; ends with a RemoteFinish. Raises RemoteError (nothing typed is touched)."""
        self._check_url()
        model = self.config.model or next(iter(self.models()), "")
        body = {"model": model, "messages": [{"role": m.role, "content": m.content} for m in messages],
                "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "stream": True,
                "stream_options": {"include_usage": True}}
        if seed is not None:
            body["seed"] = seed
        colours, finish, usage, extra = False, None, None, {}
        try:
            with self.http.stream("POST", f"{self.config.base}/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise RemoteError(_refusal(r))
                for line in r.iter_lines():
                    if cancel is not None and cancel.is_set():
                        yield RemoteFinish("cancelled", None, None, None, None, colours)
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RemoteError(f"the server failed mid-answer: {chunk['error'].get('message', '')}")
                    usage = chunk.get("usage") or usage
                    if chunk.get("timings"):
                        extra["timings"] = chunk["timings"]
                    if isinstance(chunk.get("specdec"), dict) and "tokens_per_target_forward" in chunk["specdec"]:
                        extra["specdec"] = chunk["specdec"]
                    for choice in chunk.get("choices") or []:
                        views = _views(chunk.get("specdec"))
                        colours = colours or bool(views)
                        text = (choice.get("delta") or {}).get("content") or ""
                        if text or views:
                            yield RemotePiece(text, views, *(_tree(chunk.get("specdec")) if views else (0, 0)))
                        finish = choice.get("finish_reason") or finish
        except httpx.ConnectError:
            raise RemoteError(f"cannot reach {self.config.root}: is the server running?") from None
        except httpx.TimeoutException:
            raise RemoteError(f"{self.config.root} did not answer within {self.config.timeout_s:.0f} s") from None
        except (httpx.RemoteProtocolError, httpx.ReadError):
            raise RemoteError("the server stopped in the middle of the answer") from None
        except json.JSONDecodeError:
            raise RemoteError("the server sent something that is not an OpenAI stream") from None
        if finish is None:
            raise RemoteError("the server stopped in the middle of the answer")
        timings, spec = extra.get("timings") or {}, extra.get("specdec") or {}
        yield RemoteFinish(finish, (usage or {}).get("completion_tokens"), timings.get("draft_n"),
                           timings.get("draft_n_accepted"), spec.get("tokens_per_target_forward"), colours)

    def read_metrics(self) -> RemoteMetrics:
        """Acceptance from /metrics (vLLM's names; this project's serve exports them too)."""
        text = self._call("GET", f"{self.config.root}/metrics").text
        sums: dict[str, float] = {}
        by_pos: dict[int, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                if s.name.startswith("vllm:spec_decode_num_accepted_tokens_per_pos"):
                    by_pos[int(s.labels.get("position", 0))] = by_pos.get(int(s.labels.get("position", 0)), 0) + s.value
                elif s.name.startswith("vllm:spec_decode_num_"):
                    key = s.name.removeprefix("vllm:spec_decode_num_").removesuffix("_total")
                    sums[key] = sums.get(key, 0.0) + s.value
        drafts = sums.get("drafts")
        positions = tuple(by_pos[i] / drafts for i in sorted(by_pos)) if drafts else ()
        return RemoteMetrics(drafts, sums.get("draft_tokens"), sums.get("accepted_tokens"), positions)

    def _check_url(self) -> None:
        """A URL that cannot name a server (no http(s) scheme, no host, a bad port, control characters) is one
        line before anything is sent, not httpx's exception."""
        try:
            url = httpx.URL(self.config.base)
            ok = url.scheme in ("http", "https") and bool(url.host)
        except (httpx.InvalidURL, TypeError, ValueError):
            ok = False
        if not ok:
            raise RemoteError(f"{self.config.url.strip()!r} is not a server URL: give one like http://127.0.0.1:8000/v1")

    def _call(self, method: str, url: str) -> httpx.Response:
        self._check_url()
        try:
            r = self.http.request(method, url)
        except httpx.ConnectError:
            raise RemoteError(f"cannot reach {self.config.root}: is the server running?") from None
        except httpx.TimeoutException:
            raise RemoteError(f"{self.config.root} did not answer within {self.config.timeout_s:.0f} s") from None
        except httpx.HTTPError as e:
            raise RemoteError(f"{self.config.root}: {type(e).__name__}") from None
        if r.status_code != 200:
            raise RemoteError(_refusal(r))
        return r

    @staticmethod
    def _json(r: httpx.Response) -> dict:
        try:
            return r.json()
        except ValueError:
            raise RemoteError("the server's answer is not JSON: is this an OpenAI-compatible URL?") from None


def _refusal(r: httpx.Response) -> str:
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:200]
    if r.status_code == 401:
        return f"the server refused the API key (401): {message}"
    return f"the server refused the request ({r.status_code}): {message}"


def _views(ext: object) -> tuple[TokenView, ...]:
    """This project's stream extension as TokenViews (empty for any other server)."""
    if not isinstance(ext, dict) or not isinstance(ext.get("tokens"), list):
        return ()
    step = int(ext.get("step", 0))
    views = []
    for t in ext["tokens"]:
        if not isinstance(t, dict) or t.get("status") not in STATUSES:
            continue
        q, p = t.get("q"), t.get("p")
        views.append(TokenView(token_id=int(t.get("id", 0)), text=str(t.get("text", "")), status=t["status"],
                               step=step, draft_pos=t.get("draft_pos"), q=q, p=p,
                               accept_prob=min(1.0, p / q) if q and p is not None else None,
                               source=t.get("source") if t.get("source") in SOURCES else None,
                               branch=t["branch"] if _count(t.get("branch")) else None))
    return tuple(views)


def _count(value: object) -> bool:
    """A whole number >= 0 (JSON's true is no count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tree(ext: dict) -> tuple[int, int]:
    """The step's draft tree (width, depth) from the extension; (0, 0) for a chain or a server that does not say."""
    width, depth = ext.get("tree_width"), ext.get("tree_depth")
    return (width, depth) if _count(width) and _count(depth) else (0, 0)
