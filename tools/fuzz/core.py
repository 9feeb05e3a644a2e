"""Fuzzing the real entry points with random command lines and random or mutated GGUF, prompts and settings files.

What must hold for every case: no traceback, no hang, exit code 0 or 2 only; an error (exit 2) is one
stderr line; `generate --json` prints JSON whose token texts add up to its text. Models are tiny
random ones built once into a temporary folder (tests/tiny.py); the packaged default pair is
replaced by a tiny one shipped as fake part packages, so an omitted --target never touches the
real 1.6 GB models. Most cases run in this process through app.main.main (fast); a sample runs
through real `python -m app.main`-style subprocesses, including undecodable bytes in argv.

    .venv/bin/python bench/fuzz.py                                 # 1,000 command lines, 200 files, 40 processes
    .venv/bin/python bench/fuzz.py --cases 50 --files 20 --processes 4 --seed 3   # a quick look

About 15-25 minutes for the defaults on 2 CPU cores (one torch thread). Prints a summary and every
failure (argv, reason, stderr tail); exits 1 if anything failed. Rerun a failure with the same --seed.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import io
import json
import logging
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    from tests.tiny import build_model, build_tokenizer, save_pair, write_tiny_gguf

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


# --------------------------------------------------------------------------- random values

HUGE = "9" * 30
PROMPTS = ["def add(a, b):", "Hello world!", "用Python写一个快速排序", "🙂🚀✨", "x", "", "   ", "a\nb\tc",
           "=HYPERLINK(\"http://evil.example\",\"x\")", "The quick brown fox " * 60, "caf\udce9", "\x00nul",
           "-1", "@SUM(A1)"]


FAULT_RATE = 0.15  # in a faulty case, the chance each option takes a bad value


class Faults:
    """Per case: a clean case (every value valid, so it runs deep) or a faulty one (bad values here and there)."""

    rate = 0.0

    @classmethod
    def start(cls, rng: random.Random) -> None:
        cls.rate = 0.0 if rng.random() < 0.5 else FAULT_RATE

    @classmethod
    def hit(cls, rng: random.Random) -> bool:
        return rng.random() < cls.rate


def _pick(rng: random.Random, good: tuple | list, bad: tuple | list = ()):
    return rng.choice(bad) if bad and Faults.hit(rng) else rng.choice(good)


def number_text(rng: random.Random, good: list[str], bad: list[str] | None = None) -> str:
    bad = (bad or []) + ["-1", "0", "nan", "inf", "-inf", "1e400", HUGE, "-" + HUGE, "two", "", " ", "0x10", "1.5",
                         "1_000", "9" * 5000, "٣"]
    return _pick(rng, good, bad)


def model_spec(rng: random.Random, world: World, role: str, mutated_gguf: Path | None = None) -> list[str]:
    """--target/--draft, or nothing (the tiny 'default'), or something that is not a model."""
    own = world.target if role == "target" else world.draft
    good = [[f"--{role}", str(own)]] * 8 + [[], [f"--{role}", "default"], [f"--{role}", str(world.gguf)],
                                            [f"--{role}", str(world.target)]]
    bad = [[f"--{role}", "./no/such/model"], [f"--{role}", str(world.no_config)], [f"--{role}", str(world.text_file)],
           [f"--{role}", "nobody/not-cached-model"], [f"--{role}", "~nobody_at_all/x"], [f"--{role}", "a" * 5000],
           [f"--{role}", "bad\x00path"], [f"--{role}", ""], [f"--{role}", "/proc/self"]]
    if mutated_gguf is not None:
        return [f"--{role}", str(mutated_gguf)]
    return _pick(rng, good, bad)


def decoding_options(rng: random.Random) -> list[str]:
    argv: list[str] = []
    if rng.random() < 0.6:
        argv += ["--k", number_text(rng, ["1", "2", "3", "5", "8", "12"], ["13", "40000"])]
    if rng.random() < 0.5:
        argv += ["--temperature", number_text(rng, ["0", "0.7", "1", "2", "100"])]
    if rng.random() < 0.3:
        argv += ["--top-k", number_text(rng, ["0", "1", "5", "50", "100000"])]
    if rng.random() < 0.3:
        argv += ["--top-p", number_text(rng, ["1", "0.9", "0.5", "0.01"], ["1.0000001"])]
    if rng.random() < 0.4:
        argv += ["--seed", number_text(rng, ["0", "1", "42", "4294967296", str(2**63 - 1)], [str(2**63)])]
    if rng.random() < 0.4:
        argv += ["--proposer", _pick(rng, ["draft", "ngram", "draft+ngram"], ["both", ""])]
    if rng.random() < 0.5:
        argv += ["--device", _pick(rng, ["cpu", "cpu", "auto"], ["cuda", "cuda:1", "cuda:x", "tpu", ""])]
    if rng.random() < 0.4:
        argv += ["--dtype", _pick(rng, ["float32", "float32", "bfloat16", "auto", "float16"], ["int8"])]
    if rng.random() < 0.3:
        argv += ["--fast-path", _pick(rng, ["auto", "eager", "static", "compiled"], ["turbo"])]
    if rng.random() < 0.05:
        argv += ["-v"]
    return argv


def generate_argv(rng: random.Random, world: World, gguf: Path | None = None) -> list[str]:
    argv = ["generate"]
    if not Faults.hit(rng):
        argv += ["--prompt", _pick(rng, PROMPTS[:10], PROMPTS[10:])]
    if rng.random() < 0.3:
        argv += ["--raw"]
    if rng.random() < 0.5:
        argv += ["--mode", _pick(rng, ["speculative", "standard", "standard"], ["turbo"])]
    argv += ["--max-new-tokens", number_text(rng, ["1", "2", "4", "6", "8"], ["100000"])]
    if rng.random() < 0.5:
        argv += ["--json"]
    argv += model_spec(rng, world, "target", gguf) + model_spec(rng, world, "draft") + decoding_options(rng)
    if "--device" not in argv:
        argv += ["--device", "cpu"]
    return argv


def output_path(rng: random.Random, world: World, suffix: str) -> str:
    return _pick(rng, [str(world.path(suffix))],
                 [str(world.root), str(world.root / "missing" / f"out{suffix}"), f"/proc/specdec{suffix}", ""])


def bench_argv(rng: random.Random, world: World, prompts: Path | None = None) -> list[str]:
    argv = ["bench", "--prompts", str(prompts or _pick(rng, [world.prompts],
                                                       [world.text_file, world.root / "nope.jsonl", world.root]))]
    modes = ["standard", "speculative", "hf", "hf-static", "hf-assisted", "warp", ""]
    if rng.random() < 0.8:
        chosen = rng.sample(modes[:5], rng.randint(1, 3)) if not Faults.hit(rng) else [rng.choice(modes)] * 2
        argv += ["--modes", ",".join(chosen)]
    argv += ["--max-new-tokens", number_text(rng, ["1", "2", "3", "4"])]
    argv += ["--warmup", number_text(rng, ["0", "0", "1"], ["101"])]
    if rng.random() < 0.4:
        argv += ["--json", output_path(rng, world, ".json")]
    if rng.random() < 0.4:
        argv += ["--csv", output_path(rng, world, ".csv")]
    if rng.random() < 0.2:
        argv += ["--raw"]
    argv += model_spec(rng, world, "target") + model_spec(rng, world, "draft") + decoding_options(rng)
    if "--device" not in argv:
        argv += ["--device", "cpu"]
    return argv


def cli_argv(rng: random.Random, world: World) -> list[str]:
    """One random command line: mostly plausible, sometimes garbage."""
    Faults.start(rng)
    roll = rng.random()
    if roll < 0.55:
        argv = generate_argv(rng, world)
    elif roll < 0.85:
        argv = bench_argv(rng, world)
    elif roll < 0.93:
        argv = ["cache", _pick(rng, ["info", "info", "verify", "clean"], ["defrag"])] + (
            ["--all"] if rng.random() < 0.1 else [])
    else:
        argv = rng.choice([["--quit-after-ms", "300"], ["--help"], ["generate", "--help"], ["bench"], ["generate"],
                           ["cache"], ["generate", "--prompt"], ["generate", "--bogus", "1"], ["bench", "--prompts"],
                           ["--demo", "--quit-after-ms", "200"], ["--no-draft", "--quit-after-ms", "300"]])
    if argv and Faults.hit(rng) and rng.random() < 0.3:  # a stray or repeated flag
        argv.insert(rng.randint(1, len(argv)), rng.choice(["--k", "--json", "--unknown", "--", "-x"]))
    return argv


# --------------------------------------------------------------------------- mutated files

def mutate(rng: random.Random, data: bytes, header: int = 4096) -> bytes:
    """A damaged copy: flipped bits, overwritten or cut ranges, inserted junk, a huge number, crafted arrays."""
    out = bytearray(data)
    kind = rng.choice(["flip", "flip-header", "overwrite", "truncate", "insert", "delete", "u64", "nested", "empty",
                       "magic-only", "type"])
    if kind == "flip":
        for _ in range(rng.randint(1, 20)):
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
    elif kind == "flip-header":
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(min(header, len(out)))
            out[i] ^= 1 << rng.randrange(8)
    elif kind == "overwrite":
        i = rng.randrange(len(out))
        n = rng.randint(1, 4096)
        out[i:i + n] = os.urandom(min(n, len(out) - i))
    elif kind == "truncate":
        out = out[: rng.randrange(len(out))]
    elif kind == "insert":
        i = rng.randrange(len(out))
        out[i:i] = os.urandom(rng.randint(1, 64))
    elif kind == "delete":
        i = rng.randrange(len(out))
        del out[i:i + rng.randint(1, 64)]
    elif kind == "u64":
        i = rng.randrange(0, min(header, len(out) - 8))
        out[i:i + 8] = struct.pack("<Q", rng.choice([2**63, 2**64 - 1, 2**32, 10**12]))
    elif kind == "nested":
        depth = rng.choice([5, 100, 10_000])
        out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"x" + struct.pack("<I", 9)
                        + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 0, 0))
    elif kind == "empty":
        out = bytearray()
    elif kind == "magic-only":
        out = bytearray(b"GGUF")
    elif kind == "type":
        i = rng.randrange(24, min(header, len(out) - 4))
        out[i:i + 4] = struct.pack("<I", rng.choice([13, 99, 2**31]))
    return bytes(out)


def gguf_case(rng: random.Random, world: World) -> list[str]:
    Faults.start(rng)
    path = world.path(".gguf")
    path.write_bytes(mutate(rng, world.gguf_bytes))
    return generate_argv(rng, world, gguf=path)


def prompts_case(rng: random.Random, world: World) -> list[str]:
    Faults.start(rng)
    lines = ['{"id": "a", "category": "code", "prompt": "def add(a, b):"}',
             '{"id": "b", "category": "chat", "prompt": "你好"}']
    kind = rng.choice(["bytes", "utf8", "deep", "long", "dup", "types", "surrogate", "bom-crlf", "nul", "empty",
                       "formula", "mutate"])
    if kind == "bytes":
        data = os.urandom(rng.randint(1, 2000))
    elif kind == "utf8":
        data = '{"id": "a", "prompt": "caf'.encode() + b"\xe9\xff" + b'"}\n'
    elif kind == "deep":
        data = ("[" * rng.choice([50, 5000, 200_000])).encode() + b"\n"
    elif kind == "long":
        data = json.dumps({"id": "long", "prompt": "word " * rng.choice([10, 3000])}).encode() + b"\n"
    elif kind == "dup":
        data = (lines[0] + "\n" + lines[0] + "\n").encode()
    elif kind == "types":
        data = rng.choice(['{"id": [1, {"x": 2}], "category": null, "prompt": "hi"}', '[1, 2]', '"just text"',
                           '{"prompt": 5}', '{"id": 1e400, "prompt": "x"}', "null", '{"prompt": ""}']).encode()
    elif kind == "surrogate":
        data = rng.choice(['{"id": "\\ud800", "prompt": "x"}', '{"prompt": "a\\udce9b"}',
                           '{"category": "\\udfff", "prompt": "x"}']).encode()
    elif kind == "bom-crlf":
        data = b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n"
    elif kind == "nul":
        data = b'{"id": "a\x00", "prompt": "x\x00y"}\n'
    elif kind == "empty":
        data = rng.choice([b"", b"\n\n\n", b"   \n"])
    elif kind == "formula":
        data = b'{"id": "=1+1", "category": "@cmd", "prompt": "-2+3"}\n'
    else:
        data = mutate(rng, "\n".join(lines).encode(), header=200)
    path = world.path(".jsonl")
    path.write_bytes(data)
    return bench_argv(rng, world, prompts=path)


SETTINGS_KEYS = ["generation/settings", "display/settings", "models/selection", "window/splitter", "window/view",
                 "window/geometry"]


def settings_value(rng: random.Random) -> str:
    values = [
        json.dumps({"seed": rng.choice([3000000000, -5, 10**30]), "k": rng.choice([0, 99, 10**40, "x"]),
                    "temperature": rng.choice(["nan", 1e308, -1, None]), "top_p": rng.choice([2, "inf", []]),
                    "mode": rng.choice(["turbo", 7, None]), "system_prompt": rng.choice(["x" * 200_000, 5, "ok"])}),
        json.dumps({"sizes": rng.choice([[10**20, 5, 5], [-1, 2], [], "abc", [1.5, 2.5, 3.5], list(range(100))])}),
        json.dumps({"charts_visible": rng.choice([None, "no", {"a": 1}, 0])}),
        json.dumps({"target": {"kind": rng.choice(["folder", "gguf", "hub", "alien"]),
                               "value": rng.choice(["a\x00b", "a" * 10_000, "/nope", 5])},
                    "device": rng.choice(["cuda:999999999999", "cpu", 3]), "dtype": rng.choice(["int3", None])}),
        "[" * rng.choice([10, 100_000]),
        "@ByteArray(" + "".join(f"\\x{rng.randrange(256):02x}" for _ in range(rng.randint(0, 200))) + ")",
        "@Variant(\\0\\0\\0\\x7f\\0\\0\\0\\x1cjunk)", "@Invalid()", "1, 2, 3", "", "true",
    ]
    value = rng.choice(values)
    if value.startswith("@") or value in ("1, 2, 3", "", "true"):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def settings_case(rng: random.Random, world: World) -> list[str]:
    path = world.path(".ini")
    if rng.random() < 0.2:
        path.write_bytes(os.urandom(rng.randint(1, 8000)))
    else:
        sections: dict[str, list[str]] = {}
        for _ in range(rng.randint(1, 8)):
            section, key = rng.choice(SETTINGS_KEYS).split("/")
            sections.setdefault(section, []).append(f"{key}={settings_value(rng)}")
        text = "".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items())
        data = text.encode("utf-8", "surrogatepass")
        path.write_bytes(mutate(rng, data, header=len(data)) if rng.random() < 0.2 else data)
    return ["--demo", "--settings", str(path), "--quit-after-ms", "150"]


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

    from app.window import MainWindow

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


def judge(o: Outcome) -> None:
    """Adds to o.problems whatever breaks the contract."""
    if "Traceback (most recent call last)" in o.err:
        o.problems.append("traceback on stderr")
    if o.rc is not None and o.rc not in (0, 2):
        o.problems.append(f"exit code {o.rc}")
    headless = bool(o.argv) and o.argv[0] in ("generate", "bench", "cache")
    lines = [line for line in o.err.splitlines() if line.strip()]
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


# --------------------------------------------------------------------------- main

def undecodable_argv(rng: random.Random, world: World) -> list:
    """Command lines with bytes that are not UTF-8 (they reach Python as surrogate escapes)."""
    junk = rng.choice([b"caf\xe9", b"\xff\xfe", b"ok \xc3", b"\xed\xa0\x80"])
    return rng.choice([
        ["generate", "--prompt", junk, "--target", str(world.target), "--device", "cpu"],
        ["generate", "--prompt", "hi", "--target", b"/tmp/" + junk, "--device", "cpu"],
        ["bench", "--prompts", b"/tmp/" + junk + b".jsonl"],
        ["generate", "--prompt", "hi", "--k", junk],
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=1000, help="random command lines, run in this process")
    p.add_argument("--files", type=int, default=200, help="random or mutated GGUF / prompts / settings files")
    p.add_argument("--processes", type=int, default=40, help="cases run as real subprocesses (a sample of both)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    p.add_argument("--json", type=Path, default=None, help="write every failure and the counts here")
    args = p.parse_args(argv)

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, resource.RLIM_INFINITY))
    root = Path(tempfile.mkdtemp(prefix="specdec-fuzz-"))
    os.environ.update(SPECDEC_CACHE_DIR=str(root / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      QT_QPA_PLATFORM="offscreen", SPECDEC_SETTINGS=str(root / "default-settings.ini"))
    import torch

    torch.set_num_threads(1)  # a shared machine; tiny models gain nothing from a second thread
    logging.basicConfig(level=logging.WARNING, stream=_StderrProxy(), format="%(levelname)s %(name)s: %(message)s")
    rng = random.Random(args.seed)
    started = time.perf_counter()
    world = build_world(root)
    use_tiny_defaults(world)
    dismiss_dialogs()
    print(f"fuzz: seed {args.seed}, world in {root} ({time.perf_counter() - started:.1f} s)", flush=True)

    outcomes: list[Outcome] = []
    file_makers = [("gguf", gguf_case), ("prompts", prompts_case), ("settings", settings_case)]
    plan = [("cli", None)] * args.cases + [file_makers[i % 3] for i in range(args.files)]
    for n, (kind, maker) in enumerate(plan, 1):
        case_argv = cli_argv(rng, world) if maker is None else maker(rng, world)
        outcomes.append(run_in_process(kind, case_argv))
        if n % 50 == 0 or n == len(plan):
            bad = sum(bool(o.problems) for o in outcomes)
            print(f"  {n}/{len(plan)} in process, {bad} failing, {time.perf_counter() - started:.0f} s", flush=True)
    for n in range(args.processes):
        if n % 4 == 3:
            case_argv, kind = undecodable_argv(rng, world), "cli"
        else:
            kind, maker = rng.choice([("cli", None)] * 2 + file_makers)
            case_argv = cli_argv(rng, world) if maker is None else maker(rng, world)
        outcomes.append(run_subprocess(kind, case_argv, world))
    print(f"  {args.processes} subprocesses done, {time.perf_counter() - started:.0f} s", flush=True)
    failures = [o for o in outcomes if o.problems]
    report(outcomes, failures, time.perf_counter() - started)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "seed": args.seed, "cases": len(outcomes), "failures": [
                {"kind": o.kind, "where": o.where, "argv": [a if isinstance(a, str) else repr(a) for a in o.argv],
                 "rc": o.rc, "problems": o.problems, "stderr_tail": o.err[-1500:]} for o in failures],
            "counts": summary_counts(outcomes)}, indent=2, ensure_ascii=False), encoding="utf-8")
    if args.keep:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


def summary_counts(outcomes: list[Outcome]) -> dict:
    return {
        "by_kind": dict(Counter(f"{o.kind} ({o.where})" for o in outcomes)),
        "exit_codes": dict(Counter(str(o.rc) for o in outcomes)),
        "problems": dict(Counter(p.split(":")[0].split(" (")[0] for o in outcomes for p in o.problems)),
    }


def report(outcomes: list[Outcome], failures: list[Outcome], seconds: float) -> None:
    counts = summary_counts(outcomes)
    slowest = max(outcomes, key=lambda o: o.seconds)
    print(f"\n{len(outcomes)} cases in {seconds / 60:.1f} min: " + ", ".join(f"{k} {v}" for k, v in
                                                                        sorted(counts["by_kind"].items())))
    print("exit codes: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts["exit_codes"].items())))
    print(f"slowest case {slowest.seconds:.1f} s ({slowest.where}): {_show(slowest.argv)}")
    kinds = sorted({(o.kind, o.where) for o in outcomes})
    print("mean seconds per case: " + ", ".join(
        f"{k} ({w}) {sum(o.seconds for o in outcomes if (o.kind, o.where) == (k, w)) / sum((o.kind, o.where) == (k, w) for o in outcomes):.1f}"
        for k, w in kinds))
    hangs = sum(any(p.startswith("hang") for p in o.problems) for o in outcomes)
    tracebacks = sum(any(p.startswith(("traceback", "exception")) for p in o.problems) for o in outcomes)
    others = sum(any(p.startswith("exit code") for p in o.problems) for o in outcomes)
    print(f"tracebacks: {tracebacks}, hangs: {hangs}, exits other than 0 and 2: {others}, "
          f"cases with any problem: {len(failures)}")
    errors = Counter(_reason(o.err) for o in outcomes if o.rc == 2)
    print("most frequent errors (exit 2):")
    for reason, n in errors.most_common(25):
        print(f"  {n:5d}  {reason}")
    for o in failures[:50]:
        print(f"\nFAIL [{o.kind}, {o.where}, rc {o.rc}, {o.seconds:.1f} s] {'; '.join(o.problems)}")
        print(f"  argv: {_show(o.argv)}")
        for line in o.err.strip().splitlines()[-8:]:
            print(f"  | {line[:300]}")


def _reason(err: str) -> str:
    """The error line without the values that vary between cases (paths, numbers)."""
    import re

    line = next((x for x in err.splitlines() if "error:" in x), err.strip().splitlines()[-1] if err.strip() else "")
    line = line.split("error: ", 1)[-1]
    line = re.sub(r"/tmp/specdec-fuzz-[^ ]*", "<path>", line)
    return re.sub(r"\d+", "N", line)[:90]


def _show(argv: list) -> str:
    parts = [a if isinstance(a, str) else repr(a) for a in argv]
    return " ".join(p if len(p) <= 80 else p[:80] + "…" for p in parts)


if __name__ == "__main__":
    sys.exit(main())
