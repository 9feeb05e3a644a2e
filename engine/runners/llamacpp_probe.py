"""Whether llama.cpp's AMX kernels run on this CPU: tried once per model file in a child process.

llama.cpp repacks weights for Intel AMX where the CPU advertises it. On the virtual Intel Xeon
machines this project is built on (amx_tile and amx_int8 in /proc/cpuinfo, the kernel granting the
tile state) its batched matmuls die with an illegal instruction at the first decode of a few
tokens (the real pair's Q4_K_M target, SIGILL), which took the whole app with them. On a real AMX
host they are llama.cpp's fastest CPU kernels. So where AMX is advertised, a child process loads
the model with them and decodes a batch; the verdict (ran, or died by a signal) is kept in the
cache folder, keyed by the file, the CPU and the llama.cpp version, and the app's own load follows
it. `SPECDEC_LLAMACPP_AMX=1` or `=0` decides without trying.

The child is engine/runners/llamacpp_trial.py (exit 0 when the decode ran).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from engine.models.cache import cache_dir

log = logging.getLogger(__name__)

AMX_ENV = "SPECDEC_LLAMACPP_AMX"
VERDICTS = "llamacpp-amx.json"  # in the model cache folder
PROBE_TIMEOUT_S = 300.0  # loading and repacking a model of a few GB takes seconds; a hang is a no


def forced() -> bool | None:
    """What AMX_ENV decides (1: on, 0: off), or None where it does not say."""
    value = os.environ.get(AMX_ENV)
    return value == "1" if value in ("0", "1") else None


def amx_advertised() -> bool:
    """The CPU says it has AMX tiles (Linux: /proc/cpuinfo)."""
    return " amx_tile" in _cpuinfo()


@lru_cache(maxsize=1)
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def _machine() -> str:
    """The CPU (model name and flags) and llama.cpp's version: what a verdict holds for."""
    info = _cpuinfo()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    try:
        from importlib.metadata import version

        llama = version("llama_cpp_python")
    except Exception:
        llama = "?"
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    return f"{model} | flags {digest} | llama-cpp-python {llama}"


def _key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()} | {stat.st_size} | {stat.st_mtime_ns} | {_machine()}"


def run_child(path: Path) -> int:
    """The child's exit status (negative: killed by that signal)."""
    env = {**os.environ, AMX_ENV: "1", "PYTHONUNBUFFERED": "1"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run([sys.executable, "-m", "engine.runners.llamacpp_trial", str(path)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=PROBE_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        log.warning("llama.cpp's AMX trial on %s did not finish in %.0f s", path.name, PROBE_TIMEOUT_S)
        return -9
    if done.returncode > 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        log.warning("llama.cpp's AMX trial on %s failed (exit %d): %s", path.name, done.returncode, tail[0])
    return done.returncode


def amx_runs(path: Path, progress: Callable[[str], None] | None = None,
             child: Callable[[Path], int] | None = None) -> bool:
    """Whether llama.cpp may use its AMX (extra buffer) kernels for this model here.

    True without trying where AMX is not advertised (the other CPUs' repacking is always kept) or
    the variable says 1; False where it says 0. Otherwise the kept verdict, or a trial now. A
    trial that fails for another reason (exit status > 0: the file, the memory) says no for this
    run only and is tried again next time.
    """
    if forced() is not None:
        return bool(forced())
    if not amx_advertised():
        return True
    store = cache_dir() / VERDICTS
    key = _key(path)
    verdicts = _read(store)
    if key in verdicts:
        return bool(verdicts[key])
    if progress is not None:
        progress(f"Trying llama.cpp's AMX kernels on this CPU with {path.name} (once)")
    status = (child or run_child)(path)
    if status > 0:
        return False
    runs = status == 0
    if not runs:
        log.warning("llama.cpp's AMX kernels died on this CPU (signal %d) with %s: they stay off for it (%s=1 "
                    "turns them on)", -status, path.name, AMX_ENV)
    verdicts[key] = runs
    _write(store, verdicts)
    return runs


def amx_note(names: list[str]) -> str:
    """What the status bar says of models loaded without their AMX kernels on an AMX CPU ("" if none)."""
    if not names or not amx_advertised():
        return ""
    why = f"{AMX_ENV}=0" if forced() is False else "they did not run on this CPU in a trial"
    return f"llama.cpp's AMX kernels off for {', '.join(names)}: {why}"


def _read(store: Path) -> dict[str, bool]:
    try:
        data = json.loads(store.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(store: Path, verdicts: dict[str, bool]) -> None:
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        part = store.with_name(f"{store.name}.{os.getpid()}.part")
        part.write_text(json.dumps(verdicts, indent=1), encoding="utf-8")
        os.replace(part, store)
    except OSError as exc:  # a verdict not kept is tried again next time
        log.warning("could not keep llama.cpp's AMX verdict in %s: %s", store, exc)
