"""How long does a first start take, and how much memory does the default pair hold? (prints figures)

A thin shell over `specdec-studio generate`: each start is a fresh process with its own cache
folder (SPECDEC_CACHE_DIR), answering one short prompt. The first start finds the cache empty
(assembling the packaged GGUF parts, SHA-256, the tokenizer built from the GGUF, loading, the
load-time cost pass); the second reuses what the first cached. Per start: wall seconds until the
answer is printed, and the process's peak resident memory against the size of the GGUF files it
loaded. Writes a bench record (figures under "summary") with --json.

    python bench/first_start.py --runtime llamacpp --json first_start.json
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from record import write_record  # noqa: E402


def start(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """One process: its wall seconds and peak resident memory (MB)."""
    began = time.perf_counter()
    child = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the start failed: {child.stderr.read().decode(errors='replace')[-2000:]}")
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", default="llamacpp", choices=["auto", "torch", "llamacpp"])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the physical cores)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures as a bench record")
    args = ap.parse_args()

    command = [sys.executable, "-m", "app.main", "generate", "--prompt", "Write quicksort in Python.",
               "--runtime", args.runtime, "--max-new-tokens", str(args.max_new_tokens)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    cache = Path(tempfile.mkdtemp(prefix="specdec-cold-"))
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    try:
        first = start(command, env)
        second = start(command, env)
        gguf_mb = sum(p.stat().st_size for p in cache.rglob("*.gguf")) / 2**20
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    for label, s in (("first start, empty cache", first), ("second start", second)):
        ratio = f" = {s['peak_rss_mb'] / gguf_mb:.2f}x the GGUF files ({gguf_mb:.0f} MB)" if gguf_mb else ""
        print(f"{label}: {s['seconds']:.1f} s to a {args.max_new_tokens}-token answer; peak RSS "
              f"{s['peak_rss_mb']:.0f} MB{ratio}")
    if args.json is not None:
        config = {"command": command[1:], "runtime": args.runtime, "machine": platform.processor() or platform.machine(),
                  "cpus": os.cpu_count()}
        write_record(args.json, config, {"first_start": first, "second_start": second, "gguf_mb": gguf_mb})
    return 0


if __name__ == "__main__":
    sys.exit(main())
