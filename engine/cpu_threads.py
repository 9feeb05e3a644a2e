"""How many CPU threads a forward uses and how idle ones wait: chosen so another busy program does not stall them.

Measured on two cores with the default target on llama.cpp (bench/cpu_beside_a_burner.py, docs/benchmarks.md):
llama.cpp and torch run their threads through OpenMP (one libgomp in the process: torch's, loaded first), whose
threads spin at every barrier by default. A forward has hundreds of barriers; when any other program holds one
core (even at nice 19), the thread on it waits for the scheduler while the other spins, and a 2-thread decode
fell from ~38 to ~0.6 tok/s. With OpenMP's passive wait (a thread that waits sleeps, so the core goes to
whoever needs it) two threads kept 9-16 tok/s beside the same competitors, and prompts ~26-31 tok/s where one
thread gave ~24. So: every physical core on one or two cores, one left for the window and the desktop from
four cores up (a busy thread sharing a core with a forward's thread stalls every barrier), and passive wait.

libgomp reads OMP_WAIT_POLICY once, when it loads (with torch): prepare_openmp() runs when `engine` is
imported, before anything here imports torch. A person who set OMP_WAIT_POLICY or GOMP_SPINCOUNT keeps it.
No priority is raised: ggml can, but a user's process may not lower its nice value without privileges.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

WAIT_ENV = "OMP_WAIT_POLICY"
WAIT_POLICY = "PASSIVE"  # idle OpenMP threads sleep at once instead of spinning
_USER_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # what a person may set to choose otherwise
_OPENMP_USERS = ("torch", "llama_cpp")  # importing either loads libgomp, which reads the variables then
SPARE_FROM = 4  # from this many cores up, one is left to the window and other programs


@dataclass(frozen=True)
class ThreadPolicy:
    """Threads for one model's forwards, and why."""

    decode: int  # threads for a forward of one row (a standard step, a draft token)
    batch: int  # threads for a forward of several rows (the prompt, a verify)
    wait: str  # how idle threads wait: "passive" (they sleep), "spin" (OpenMP's default) or what a person set
    chosen: str  # "auto" (from the cores found) or "setting" (a person asked for a count)
    cores: int  # physical cores the choice was made for

    def label(self) -> str:
        """'2 threads', '3 threads (4 for prompts)'."""
        text = f"{self.decode} thread{'s' if self.decode != 1 else ''}"
        return text if self.batch == self.decode else f"{text} ({self.batch} for prompts)"

    def describe(self) -> str:
        """One line for a tooltip or a benchmark: the counts, the wait, where they came from."""
        how = ("set in the Models dialog or with --threads" if self.chosen == "setting"
               else f"chosen for {self.cores} physical core{'s' if self.cores != 1 else ''}")
        return f"{self.label()}, {how}; idle threads {_WAITS.get(self.wait, self.wait)}"


_WAITS = {"passive": "sleep (OMP_WAIT_POLICY=PASSIVE)", "spin": "spin (OpenMP's default)"}


def choose_threads(cores: int, requested: int | None = None, wait: str | None = None) -> ThreadPolicy:
    """The policy for `cores` physical cores; `requested` (> 0) is a person's count, used for both widths."""
    cores = max(1, int(cores))
    wait = wait or wait_policy()
    if requested is not None and requested > 0:
        return ThreadPolicy(int(requested), int(requested), wait, "setting", cores)
    decode = cores - 1 if cores >= SPARE_FROM else cores
    return ThreadPolicy(decode, cores, wait, "auto", cores)


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthreads do not speed up a memory-bound decode)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores: set[tuple[str, str]] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu, package = -1, "0"
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu = int(value)
                elif key == "physical id":
                    package = value
                elif key == "core id" and cpu in allowed:
                    cores.add((package, value))
    except (OSError, ValueError):
        pass
    return max(1, min(len(cores) or len(allowed), len(allowed)))


_wait: str | None = None  # what prepare_openmp() found: the wait this process's OpenMP runs with


def prepare_openmp(environ: MutableMapping[str, str] | None = None, modules: Mapping[str, object] | None = None) -> str:
    """Asks OpenMP for passive waiting unless a person chose (or OpenMP already loaded); returns the wait in force."""
    global _wait
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if any(name in environ for name in _USER_WAIT_VARS):
        asked = environ.get(WAIT_ENV, "").strip().lower()
        _wait = {"passive": "passive", "active": "spin"}.get(asked) or f"GOMP_SPINCOUNT={environ.get('GOMP_SPINCOUNT')}"
    elif any(name in modules for name in _OPENMP_USERS):
        _wait = "spin"  # too late: libgomp read its (empty) variables when it loaded
    else:
        environ[WAIT_ENV] = WAIT_POLICY
        _wait = "passive"
    return _wait


def wait_policy() -> str:
    """The wait this process's OpenMP threads use ("passive", "spin", or a person's GOMP_SPINCOUNT)."""
    return _wait if _wait is not None else prepare_openmp()
