"""How does `serve` hold up under load? N requests from C concurrent clients against a fresh server.

Starts `python -m app.main serve` on a free loopback port with the model options given after `--`,
sends the prompts of assets/bench_prompts.jsonl (greedy, mixed answer lengths) from C threads over
the OpenAI streaming API, mixes in a few bad requests (malformed JSON, an unknown model: they must
get 400/404 and change nothing), then asks every prompt once more alone and checks that every answer
under load equals its single-request answer. Prints requests/s, p50/p99 time to first token and to
the end, the server's peak RSS, errors; writes the figures as JSON. RSS must stay flat: the server's
RSS once the last request is answered may be at most RSS_RISE above its RSS once the first third
was, or the run fails (a leak grows with the requests served; the first third pays the one-off growth
of warm-up, caches and allocator pools).

    python bench/serve_load.py --requests 200 --clients 8 --json bench/results/serve_load_cpu.json \
        -- --runtime llamacpp --mode speculative --k 3
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (8, 24, 48, 96)  # max_tokens, by prompt: short and long answers in one run
BAD = ({"content": b'{"model": "x", "messages": ['}, {"json": {"model": "no-such-model", "prompt": "hi"}})
RSS_RISE = 0.10  # most RSS may grow from the first third of the requests answered to the last


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(field)), 0)
    except OSError:
        return 0


def _ask(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat answer: its text, time to first token and to the end, and an error if any."""
    t0 = time.perf_counter()
    first, parts, error = None, [], None
    body = {"model": None, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.read()[:200]!r}"}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    break
                text = (chunk["choices"][0]["delta"].get("content") or "") if chunk["choices"] else ""
                if text and first is None:
                    first = time.perf_counter() - t0
                parts.append(text)
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter() - t0
    return {"text": "".join(parts), "ttft": first if first is not None else end, "e2e": end, "error": error}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(round(q * (len(ordered) - 1))), len(ordered) - 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompts", type=Path, default=ROOT / "assets" / "bench_prompts.jsonl")
    ap.add_argument("--unique", type=int, default=10, help="distinct prompts (each with its own answer length)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("serve_args", nargs="*", help="after --: model options for `serve`")
    args = ap.parse_args()
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text(encoding="utf-8").splitlines()
               if line.strip()][: args.unique]
    work = [(i % len(prompts), LENGTHS[(i % len(prompts)) % len(LENGTHS)]) for i in range(args.requests)]

    port = _free_port()
    cmd = [sys.executable, "-m", "app.main", "serve", "--port", str(port), "--max-seqs", "4",
           "--queue", str(4 * args.clients), *args.serve_args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=args.timeout) as client:
            deadline = time.monotonic() + 900
            while True:
                if server.poll() is not None:
                    print(f"serve exited with {server.returncode}", file=sys.stderr)
                    return 1
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    print("serve did not come up", file=sys.stderr)
                    return 1
                time.sleep(0.5)
            rss_loaded = _rss_kib(server.pid, "VmRSS:")
            results: list[dict | None] = [None] * len(work)
            bad_status: list[int] = []
            peak = [rss_loaded]
            done = threading.Event()
            cursor = iter(range(len(work)))
            lock = threading.Lock()
            finished = [0]  # requests answered so far
            rss_first_third = [rss_loaded]  # the server's RSS once a third of the requests were answered

            def sampler() -> None:
                while not done.wait(0.5):
                    peak.append(_rss_kib(server.pid, "VmRSS:"))

            def worker(n: int) -> None:
                with httpx.Client(timeout=args.timeout) as own:
                    while True:
                        with lock:
                            i = next(cursor, None)
                        if i is None:
                            return
                        if i % 50 == 25:  # now and then a bad request beside the good ones (4 in 200)
                            bad = BAD[(i // 50) % len(BAD)]  # malformed JSON, then an unknown model
                            path = "/v1/chat/completions" if "content" in bad else "/v1/completions"
                            headers = {"content-type": "application/json"}
                            bad_status.append(own.post(f"{url}{path}", headers=headers, **bad).status_code)
                        p, max_tokens = work[i]
                        results[i] = _ask(own, url, prompts[p], max_tokens)
                        with lock:
                            finished[0] += 1
                            if finished[0] == max(len(work) // 3, 1):
                                rss_first_third[0] = _rss_kib(server.pid, "VmRSS:")

            threading.Thread(target=sampler, daemon=True).start()
            t0 = time.perf_counter()
            threads = [threading.Thread(target=worker, args=(n,)) for n in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            done.set()
            rss_after_load = _rss_kib(server.pid, "VmRSS:")
            alone = {p: _ask(client, url, prompts[p], LENGTHS[p % len(LENGTHS)]) for p in sorted({p for p, _ in work})}
            metrics = client.get(f"{url}/metrics").text
    finally:
        peak_hwm = _rss_kib(server.pid, "VmHWM:")
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()

    answered = [r for r in results if r is not None]
    errors = [r["error"] for r in answered if r.get("error")]
    good = [r for r in answered if not r.get("error")]
    differ = [{"request": i, "prompt": p, "first_difference": next(
                   (j for j, (a, b) in enumerate(zip(r["text"], alone[p]["text"])) if a != b),
                   min(len(r["text"]), len(alone[p]["text"])))}
              for i, ((p, _), r) in enumerate(zip(work, results))
              if r and not r.get("error") and r["text"] != alone[p]["text"]]
    mismatched = len(differ)
    rss_rise = rss_after_load / max(rss_first_third[0], 1) - 1.0
    figures = {
        "requests": len(work), "clients": args.clients, "unique_prompts": len(prompts), "wall_s": wall,
        "requests_per_s": len(good) / wall, "errors": len(errors), "first_errors": errors[:3],
        "bad_requests": len(bad_status), "bad_request_statuses": sorted(set(bad_status)),
        "ttft_p50_s": _percentile([r["ttft"] for r in good], 0.5), "ttft_p99_s": _percentile([r["ttft"] for r in good], 0.99),
        "e2e_p50_s": _percentile([r["e2e"] for r in good], 0.5), "e2e_p99_s": _percentile([r["e2e"] for r in good], 0.99),
        "rss_loaded_mib": rss_loaded / 1024, "rss_first_third_mib": rss_first_third[0] / 1024,
        "rss_after_load_mib": rss_after_load / 1024, "rss_peak_mib": max(max(peak), peak_hwm) / 1024,
        "rss_rise": rss_rise, "rss_flat": rss_rise <= RSS_RISE,
        "greedy_equal_to_alone": len(good) - mismatched, "greedy_compared": len(good),
        "differ": differ[:20],  # where an answer under load first differs from its answer alone (characters)
        "alone_e2e_mean_s": statistics.fmean(a["e2e"] for a in alone.values()),
        "serve_args": args.serve_args,
        "spec_decode": {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("vllm:spec_decode_num_") and "_total" in line and "per_pos" not in line},
    }
    for key, value in figures.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if not figures["rss_flat"]:
        print(f"FAIL: RSS rose {rss_rise:+.1%} from the first third of the requests to the last "
              f"({rss_first_third[0] / 1024:.0f} -> {rss_after_load / 1024:.0f} MiB; at most {RSS_RISE:+.0%})",
              file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    ok = not errors and not mismatched and set(bad_status) <= {400, 404} and figures["rss_flat"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
