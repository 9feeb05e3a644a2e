"""`specdec-studio serve`: the loaded pair behind an OpenAI-compatible HTTP API (app/serve/)."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import socket
import sys

from app.cli import common
from app.cli import options as opt
from app.cli.common import PROG
from engine.limits import MAX_NEW_TOKENS
from engine.types import MODES

log = logging.getLogger(__name__)


def _port(text: str) -> int:
    return opt.whole(text, 0, 65535, "the port")


def _queue(text: str) -> int:
    return opt.whole(text, 0, 100_000, "the queue length")


def _api_key(text: str) -> str:
    key = opt.utf8(text, "the API key").strip()
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise argparse.ArgumentTypeError("the API key must be printable text without spaces")
    return key


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `serve` and its own options; the caller adds the model options shared with `generate`."""
    p = subparsers.add_parser("serve", help="serve the pair over an OpenAI-compatible HTTP API (/v1)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    s.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    s.add_argument("--api-key", type=_api_key, default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    s.add_argument("--max-seqs", type=opt.sequences, default=4,
                   help="sequences (greedy or sampled) decoded together in one batch (default 4)")
    s.add_argument("--queue", type=_queue, default=16,
                   help="requests that may wait beyond --max-seqs; one more is answered 429 (default 16)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the target's display name)")
    s.add_argument("--mode", default="speculative", choices=list(MODES), help="how every request decodes")
    s.add_argument("--max-new-tokens", type=opt.max_new_tokens, default=512,
                   help=f"answer length when a request sets no max_tokens (1 to {MAX_NEW_TOKENS})")
    return p


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any model loads (a taken port is one line, not a traceback)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve --host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    return sock


def run(args: argparse.Namespace) -> int:
    """Loads the pair, then serves until interrupted."""
    import uvicorn  # the server stack waits until serve really runs: every other command starts without it

    from app.serve.api import ServeConfig, create_app
    from app.serve.protocol import Defaults
    from engine.serving.scheduler import Scheduler

    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    if not _loopback(args.host):
        guard = "an API key is required" if args.api_key else "no --api-key: anyone who can reach it may use it"
        print(f"{PROG}: listening on {args.host}:{port}, reachable from other machines ({guard})", file=sys.stderr)
    needs_draft = args.mode != "standard" and args.proposer in ("draft", "draft+ngram")
    try:
        engine = common.load_engine(args, needs_draft, keep_costs=True, sequences=args.max_seqs)
        scheduler = Scheduler(engine, max_seqs=args.max_seqs, queue_size=args.queue)
        defaults = Defaults(mode=args.mode, proposer=args.proposer, k=args.k, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed, max_tokens=args.max_new_tokens)
        model = args.served_model_name or engine.info.target_name
        app = create_app(scheduler, ServeConfig(model=model, defaults=defaults, api_key=args.api_key))
        shown = f"[{host}]" if ":" in host else host
        print(f"{PROG}: serving {model} at http://{shown}:{port}/v1 (metrics at /metrics); Ctrl+C stops it",
              file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level="info" if args.verbose else "warning",
                                               timeout_graceful_shutdown=5))
        try:
            server.run(sockets=[sock])
        finally:
            scheduler.close()
    finally:
        sock.close()
    return 0

