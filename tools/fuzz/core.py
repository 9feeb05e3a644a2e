"""Fuzzing the real entry points: the world the cases point at, running a case and judging it.

Random command lines and random or mutated GGUF, prompts and settings files (cases.py); crafted
conversations, foreign settings files, cache and work folders holding foreign things, configs with
zero or negative sizes (files.py), with a sentinel folder hashed before and after.

What must hold for every case: no traceback, no hang, exit code 0 or 2 only; an error (exit 2) is one
stderr line; `generate --json` prints JSON whose token texts add up to its text. Models are tiny
random ones built once into a temporary folder (tests/tiny.py); the packaged default pair is
replaced by a tiny one shipped as fake part packages, so an omitted --target never touches the
real 1.6 GB models. Most cases run in this process through app.main.main (fast); a sample runs
through real `python -m app.main`-style subprocesses, including undecodable bytes in argv.

    nice -n 10 .venv/bin/python -m tools.fuzz --cases 2000        # the long form, by hand
    .venv/bin/python -m tools.fuzz --cases 50 --files 20 --processes 4 --seed 3   # a quick look
    tests/test_fuzz.py runs a short form (fixed seed) in CI.

About 15-25 minutes for the defaults on 2 CPU cores (one torch thread). Prints a summary and every
failure (argv, reason, stderr tail); exits 1 if anything failed. Rerun a failure with the same --seed.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CASE_TIMEOUT_S = 120  # one in-process case; tiny models answer in about a second
PROCESS_TIMEOUT_S = 240  # one subprocess (imports torch and transformers first)
MEMORY_LIMIT = 12 << 30  # address space for this process: a crafted file must not eat the shared machine


# --------------------------------------------------------------------------- the world

@dataclass
class World:
    """Everything the cases point at, built once."""

    root: Path  # temporary folder holding all of it
    target: Path  # tiny target model folder
    draft: Path  # tiny draft model folder (noisy copy, same tokenizer)
    gguf: Path  # the tiny target as a GGUF file
    gguf_bytes: bytes  # its content, to mutate
    prompts: Path  # a valid prompts file
    no_config: Path  # a folder that is not a model
    text_file: Path  # a file that is not a .gguf
    packages: Path  # fake part packages of the "default" pair
    default_models: dict  # role -> PackedModel-like tuple (name, packages, sha256, size)
    counter: int = 0

    def path(self, suffix: str) -> Path:
        self.counter += 1
        return self.root / "cases" / f"case{self.counter:05d}{suffix}"


def build_world(root: Path) -> World:
    from tests.tiny import build_model, build_tokenizer, save_pair
    from tests.tiny_gguf import write_tiny_gguf

    tok = build_tokenizer()
    target, draft = save_pair(root / "pair", noise=0.05, seed=0, tokenizer=tok)
    gguf = write_tiny_gguf(root / "tiny.gguf", tok, build_model(len(tok), seed=0))
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"id": "a", "category": "code", "prompt": "def add(a, b):"}\n'
                       '{"id": "b", "category": "chat", "prompt": "你好，世界 🙂"}\n', encoding="utf-8")
    no_config = root / "not-a-model"
    no_config.mkdir()
    (no_config / "README").write_text("nothing here")
    text_file = root / "notes.txt"
    text_file.write_text("not a model")
    (root / "cases").mkdir()
    data = gguf.read_bytes()
    packages = root / "pkgs"
    default_models = {}
    for role in ("target", "draft"):
        names = []
        third = len(data) // 3 + 1
        for i, start in enumerate(range(0, len(data), third), 1):
            pkg = packages / f"specdec_fuzz_{role}_part{i}"
            (pkg / "data").mkdir(parents=True)
            (pkg / "__init__.py").write_text("raise RuntimeError('part packages are data, never imported')\n")
            (pkg / "data" / f"part{i:02d}.bin").write_bytes(data[start:start + third])
            names.append(pkg.name)
        default_models[role] = (f"Fuzz-{role}", tuple(names), hashlib.sha256(data).hexdigest(), len(data))
    return World(root, target, draft, gguf, data, prompts, no_config, text_file, packages, default_models)


def dismiss_dialogs() -> None:
    """In this process, message boxes answer at once (a person would click OK) and print their text."""
    from PySide6.QtWidgets import QMessageBox

    def answer(kind: str):
        def show(_parent, title, text, *args, **kwargs):
            print(f"[{kind} dialog] {title}: {text}", file=sys.stderr)
            return QMessageBox.StandardButton.Ok
        return show

    for kind in ("critical", "warning", "information", "question"):
        setattr(QMessageBox, kind, answer(kind))


def use_tiny_defaults(world: World) -> None:
    """In this process: the packaged default pair is the tiny one (never the real 1.6 GB download)."""
    from engine.models import store

    sys.path.insert(0, str(world.packages))
    for role, (name, packages, sha, size) in world.default_models.items():
        store.DEFAULT_MODELS[role] = store.PackagedModel(name, packages, sha, size)


# --------------------------------------------------------------------------- running and judging

@dataclass
class Outcome:
    kind: str  # "cli", "gguf", "prompts", "settings"
    argv: list  # what was run (str, or bytes for undecodable arguments)
    where: str  # "process" (this one) or "subprocess"
    rc: int | None  # exit code (None: it never finished)
    out: str  # stdout
    err: str  # stderr
    seconds: float  # wall time
    problems: list[str] = field(default_factory=list)  # what went wrong; empty when all held


class _Hang(BaseException):
    """Raised by the alarm in a case that ran too long."""


class _StderrProxy(io.TextIOBase):
    """Logging's stream: whatever sys.stderr is at the time of each record (captured per case)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _Capture(io.StringIO):
    def isatty(self) -> bool:
        return False


def run_in_process(kind: str, argv: list[str]) -> Outcome:
    from app.main import main

    out, err = _Capture(), _Capture()
    started = time.perf_counter()
    rc: int | None = None
    problems: list[str] = []

    def alarm(_signum, _frame):
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(CASE_TIMEOUT_S)
    # Inside Qt's event loop the alarm's handler cannot run: a second watchdog ends that loop.
    stuck = threading.Event()

    def quit_event_loop() -> None:
        from PySide6.QtCore import QCoreApplication

        stuck.set()
        app = QCoreApplication.instance()
        if app is not None:
            app.quit()

    watchdog = threading.Timer(CASE_TIMEOUT_S + 5, quit_event_loop)
    watchdog.daemon = True
    watchdog.start()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except _Hang:
        problems.append(f"hang: more than {CASE_TIMEOUT_S} s")
    except BaseException as e:  # noqa: BLE001 - every escape is a finding
        import traceback

        problems.append(f"exception: {type(e).__name__}: {str(e)[:200]}")
        err.write(traceback.format_exc())
    finally:
        watchdog.cancel()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if stuck.is_set() and not problems:
        problems.append(f"hang: the event loop ran more than {CASE_TIMEOUT_S} s")
    _forget_windows()
    gc.collect()
    outcome = Outcome(kind, argv, "process", rc, out.getvalue(), err.getvalue(), time.perf_counter() - started,
                      problems)
    judge(outcome)
    return outcome


def _forget_windows() -> None:
    """After an app case in this process: its window is collected, as it is when a real app exits.

    The window freezes the garbage collector's view once models load (gc.freeze), so without this
    every window of every case would stay alive, and each new stylesheet would re-polish them all.
    """
    gc.unfreeze()
    widgets = sys.modules.get("PySide6.QtWidgets")
    app = widgets.QApplication.instance() if widgets is not None else None
    if app is None:
        return
    import shiboken6

    from app.ui.window import MainWindow

    for widget in app.topLevelWidgets():
        # Signal connections to the window's own lambdas keep it alive through C++: delete it the
        # way the end of a real process does.
        if isinstance(widget, MainWindow) and not widget.isVisible():
            shiboken6.delete(widget)
    gc.collect()


def run_subprocess(kind: str, argv: list, world: World) -> Outcome:
    """The real entry point in a fresh interpreter (the tiny pair standing in for the packaged default)."""
    boot = ("import sys; sys.path[:0] = [{root!r}, {pkgs!r}]\n"
            "from engine.models import store\n"
            "for role, (name, packages, sha, size) in {models!r}.items():\n"
            "    store.DEFAULT_MODELS[role] = store.PackagedModel(name, packages, sha, size)\n"
            "from app.main import main\n"
            "sys.exit(main())\n").format(root=str(ROOT), pkgs=str(world.packages), models=world.default_models)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", boot, *argv], env=env, capture_output=True,
                              timeout=PROCESS_TIMEOUT_S, cwd=world.root)
        rc, out, err, problems = proc.returncode, proc.stdout, proc.stderr, []
    except subprocess.TimeoutExpired as e:
        rc, out, err, problems = None, e.stdout or b"", e.stderr or b"", [f"hang: more than {PROCESS_TIMEOUT_S} s"]
    outcome = Outcome(kind, argv, "subprocess", rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                      time.perf_counter() - started, problems)
    judge(outcome)
    return outcome


NOTICES = ("specdec-studio: The cached",)  # one-line notices that may precede an error line
PLAN = "Memory plan:"  # how a plan that does not fit begins (engine/models/plan.py: format_plan), before its error


def judge(o: Outcome) -> None:
    """Adds to o.problems whatever breaks the contract."""
    if "Traceback (most recent call last)" in o.err:
        o.problems.append("traceback on stderr")
    if o.rc is not None and o.rc not in (0, 2):
        o.problems.append(f"exit code {o.rc}")
    headless = bool(o.argv) and o.argv[0] in ("generate", "bench", "cache")
    lines = [line for line in o.err.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith(PLAN)]
    if lines and "will not fit" in lines[-1] and starts:  # the memory plan says why, then comes the one error line
        lines = lines[:starts[0]] + lines[-1:]
    if "Warning:" in o.err or "FutureWarning" in o.err:
        o.problems.append("a warning on stderr")
    if "internal error (" in o.err:
        o.problems.append("internal error (a bug the CLI's safety net caught)")
    if o.rc == 2 and headless:
        verbose = "-v" in o.argv or "--verbose" in o.argv  # logs come first by request; the error is last
        errors = [line for line in lines if not line.startswith(NOTICES)][-1:] if verbose else \
            [line for line in lines if not line.startswith(NOTICES)]
        if len(errors) != 1 or not errors[0].startswith("specdec-studio: error: "):
            o.problems.append(f"error is not one stderr line ({len(errors)} lines)")
        elif len(errors[0]) > 600:
            o.problems.append("error line longer than 600 characters")
    if o.rc == 0 and headless and o.argv[0] == "generate" and "--json" in o.argv and "--help" not in o.argv:
        try:
            result = json.loads(o.out)
            kept = "".join(t["text"] for t in result["tokens"] if t["status"] != "rejected")
            if kept != result["text"]:
                o.problems.append("token texts do not add up to the text")
        except (ValueError, KeyError, TypeError) as e:
            o.problems.append(f"--json output is not the JSON contract ({e})")

