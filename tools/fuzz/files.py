"""Fuzz cases for the files people have: crafted conversations and index entries, foreign settings files, cache
and work folders holding foreign things, configs with zero or negative sizes.

Each case runs in this process through the real entry points (the store, AppSettings, `cache` and
`generate` through app.main.main, a Distiller on a tiny target). Crafted inputs point at a sentinel
folder outside the case folders (links, path ids, pickles that would write there); it is hashed
before and after every case, so a file changed or deleted outside the temp folders is a failure.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import signal
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tools.fuzz.core import CASE_TIMEOUT_S, Outcome, World, _Capture, _Hang, run_in_process

WRONG = [None, True, 0, -1, 1e308, "x", "", [], ["a"], {}, {"a": 1}, "../../sentinel/victim", 10**30]


# --------------------------------------------------------------------------- the sentinel

def sentinel(world: World) -> Path:
    """A folder outside every case folder, with files crafted inputs point at; created once."""
    folder = world.root / "sentinel"
    if not folder.exists():
        (folder / "models" / "precious").mkdir(parents=True)
        (folder / "victim.json").write_text('{"mine": true}', encoding="utf-8")
        (folder / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n", encoding="utf-8")
        (folder / "models" / "precious" / "model.safetensors").write_bytes(b"weights of mine")
        (folder / "own.gguf").write_bytes(b"GGUF of mine")
    return folder


def tree_hash(folder: Path) -> str:
    """Names, kinds, link targets and contents of everything under `folder` (links not followed)."""
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(folder, followlinks=False)):
        dirs.sort()
        for name in sorted(dirs + files):
            path = Path(root) / name
            h.update(str(path.relative_to(folder)).encode("utf-8", "surrogateescape") + b"\0")
            if path.is_symlink():
                h.update(b"L" + os.readlink(path).encode("utf-8", "surrogateescape"))
            elif path.is_file():
                h.update(b"F" + path.read_bytes())
    return h.hexdigest()


def run_call(kind: str, label: str, world: World, call: Callable[[], int], guarded: list[Path] = ()) -> Outcome:
    """Runs one direct call under the hang alarm: an exception that escapes is a finding; the sentinel
    and every `guarded` path must be byte for byte as before."""
    out, err = _Capture(), _Capture()
    before = tree_hash(sentinel(world))
    guards = {p: tree_hash(p) if p.is_dir() else _file_hash(p) for p in guarded}
    started = time.perf_counter()
    rc: int | None = None
    problems: list[str] = []

    def alarm(_signum, _frame):
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = call()
    except _Hang:
        problems.append(f"hang: more than {CASE_TIMEOUT_S} s")
    except BaseException as e:  # noqa: BLE001 - every escape is a finding
        import traceback

        problems.append(f"exception: {type(e).__name__}: {str(e)[:200]}")
        err.write(traceback.format_exc())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    outcome = Outcome(kind, [label], "process", rc, out.getvalue(), err.getvalue(), time.perf_counter() - started,
                      problems)
    _judge_outside(outcome, world, before, guards)
    return outcome


def _file_hash(path: Path) -> str:
    if path.is_symlink():
        return "link:" + os.readlink(path)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "absent"


def _judge_outside(o: Outcome, world: World, before: str, guards: dict[Path, str]) -> None:
    with_outside_check(o, world, before, guards)
    if "Traceback (most recent call last)" in o.err and not any(p.startswith("exception") for p in o.problems):
        o.problems.append("traceback on stderr")
    if o.rc is not None and o.rc not in (0, 2):
        o.problems.append(f"exit code {o.rc}")


def with_outside_check(o: Outcome, world: World, before: str, guards: dict[Path, str]) -> Outcome:
    """Adds a problem when the sentinel folder or a guarded path is not as it was."""
    if tree_hash(sentinel(world)) != before:
        o.problems.append("outside change: the sentinel folder changed")
    for path, digest in guards.items():
        if (tree_hash(path) if path.is_dir() and not path.is_symlink() else _file_hash(path)) != digest:
            o.problems.append(f"outside change: {path.name} changed")
    return o


# --------------------------------------------------------------------------- conversations

def conversation_case(rng: random.Random, world: World) -> Outcome:
    from app.core.chat_tree import ConversationFormatError
    from app.core.conversations import INDEX_NAME, ConversationStore
    from app.core.demo import demo_conversations

    folder = world.path("-conversations")
    ids = demo_conversations(ConversationStore(folder), rng.randint(1, 3), turns=rng.choice([2, 4, 6]),
                             tokens=rng.random() < 0.5, seed=rng.randrange(100))
    ConversationStore(folder).list()  # writes the index, to be damaged too
    for _ in range(rng.randint(1, 4)):
        _damage_conversations(rng, folder, ids, INDEX_NAME)

    def call() -> int:
        store = ConversationStore(folder)
        headers = store.list()
        for header in headers:
            try:
                c = store.load(header.id)
            except (ConversationFormatError, OSError):
                continue
            c.messages()
            for turn in list(c.turns.values())[:20]:
                c.path(turn.id)
                c.switch_to(turn.id)
        store.search(rng.choice(["", "quick", "Note 0", "你", "\"", "zzz"]))
        for bad in ("../../sentinel/victim", "../victim", "/etc/passwd", "a/b", ".."):
            with contextlib.suppress(ConversationFormatError):
                store.delete(bad)
                store.restore(bad)
        if headers:
            victim = rng.choice(headers).id
            store.delete(victim)
            store.restore(victim)
        ConversationStore(folder)  # the next start empties the trash
        return 0

    return run_call("conversations", f"conversations {folder.name}", world, call)


def _damage_conversations(rng: random.Random, folder: Path, ids: list[str], index_name: str) -> None:
    kind = rng.choice(["cycle", "self-parent", "top-type", "turn-type", "path-id", "extra", "index-extra",
                       "index-type", "index-path", "index-junk", "junk-file", "deep"])
    cid = rng.choice(ids)
    path = folder / f"{cid}.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(raw, dict) or not isinstance(raw.get("turns"), list) or not all(
            isinstance(t, dict) for t in raw["turns"]):
        return  # damaged past further damage by an earlier round
    if kind == "cycle" and len(raw["turns"]) > 1:
        raw["turns"][0]["parent"] = raw["turns"][-1]["id"]
    elif kind == "self-parent" and raw["turns"]:
        turn = rng.choice(raw["turns"])
        turn["parent"] = turn["id"]
    elif kind == "top-type":
        raw[rng.choice(["current", "title", "settings", "turns", "trim_oldest", "id", "version", "created",
                        "model"])] = rng.choice(WRONG)
    elif kind == "turn-type" and raw["turns"]:
        turn = rng.choice(raw["turns"])
        key = rng.choice(["id", "parent", "role", "content", "summary", "request", "tokens", "model", "error",
                          "created"])
        if isinstance(turn.get(key), dict) and rng.random() < 0.6:
            inner = turn[key]
            if inner:
                inner[rng.choice(list(inner))] = rng.choice(WRONG)
        else:
            turn[key] = rng.choice(WRONG)
    elif kind == "path-id":
        raw["id"] = rng.choice(["../../sentinel/victim", "../x", "/etc/passwd", "a/b", "..", ".hidden"])
    elif kind == "extra":
        raw[rng.choice(["pinned", "tags", "__proto__", "format2"])] = rng.choice(WRONG)
    else:
        _damage_index(rng, folder / index_name, cid, kind)
        return
    path.write_text(json.dumps(raw), encoding="utf-8")


def _damage_index(rng: random.Random, index: Path, cid: str, kind: str) -> None:
    folder = index.parent
    if kind == "junk-file":
        name = rng.choice(["junk.json", "x.txt", "a b.json", "..json"])
        (folder / name).write_bytes(os.urandom(rng.randint(0, 4000)) if rng.random() < 0.5 else b"[" * 50_000)
        return
    if kind == "deep":
        (folder / "deep.json").write_text("[" * 200_000, encoding="utf-8")
        return
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    entries = raw.get("entries") if isinstance(raw, dict) else None
    entry = entries.get(cid) if isinstance(entries, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("header"), dict) or not entry["header"]:
        return
    if kind == "index-extra":
        entry["header"]["pinned"] = rng.choice(WRONG)
        raw[rng.choice(["written_by", "damaged"])] = rng.choice(WRONG)
    elif kind == "index-type":
        target = entry if rng.random() < 0.4 else entry["header"]
        target[rng.choice(list(target))] = rng.choice(WRONG)
    elif kind == "index-path":
        entry["header"]["id"] = "../../sentinel/victim"
        raw["entries"]["../../sentinel/victim"] = entry
    else:
        raw = rng.choice([[], "index", {"version": 1, "entries": []}, {"version": 1, "entries": {cid: 5}}])
    index.write_text(json.dumps(raw), encoding="utf-8")


# --------------------------------------------------------------------------- settings files

def settings_foreign_case(rng: random.Random, world: World) -> Outcome:
    from app.ui.settings import AppSettings
    from engine.settings import ModelChoice, ModelSelection

    kind = rng.choice(["text", "binary", "link-passwd", "fifo", "folder", "dangling", "other-ini", "ours-junk",
                       "link-ours"])
    path = world.path(".ini")
    guard = path
    if kind == "text":
        path.write_text("notes\n" * rng.randint(1, 20000), encoding="utf-8")
    elif kind == "binary":
        path.write_bytes(os.urandom(rng.randint(1, 20000)))
    elif kind == "link-passwd":
        path.symlink_to(sentinel(world) / "passwd")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "dangling":
        path.symlink_to(sentinel(world) / "new-settings.ini")
    elif kind == "other-ini":
        path.write_text("[database]\nhost=localhost\n", encoding="utf-8")
    elif kind == "ours-junk":
        path.write_text("[window]\nsplitter=\"[[[[\"\n[generation]\nsettings=5\n", encoding="utf-8")
    else:
        mine = world.path("-mine.ini")
        mine.write_text("[window]\nview=\"{}\"\n", encoding="utf-8")
        path.symlink_to(mine)
    guarded = [] if kind in ("ours-junk", "link-ours") else [guard]
    if rng.random() < 0.15 and kind != "folder":
        before = tree_hash(sentinel(world))
        guards = {p: _file_hash(p) for p in guarded if not p.is_dir()}
        o = run_in_process("settings-foreign", ["--demo", "--settings", str(path), "--quit-after-ms", "150"])
        return with_outside_check(o, world, before, guards)

    def call() -> int:
        s = AppSettings(path)
        s.models(), s.generation(), s.display(), s.geometry(), s.splitter_sizes(), s.theme(), s.sidebar_width()
        s.set_models(ModelSelection(target=ModelChoice.from_spec("some/model")))
        s.set_theme("dark")
        s.set_splitter_sizes([1, 2, 3])
        s.sync()
        return 0

    return run_call("settings-foreign", f"settings {kind}", world, call, [p for p in guarded if not p.is_dir()])


# --------------------------------------------------------------------------- cache folders

def cache_case(rng: random.Random, world: World) -> Outcome:
    from engine.models.cache_space import TAG, TAG_TEXT

    root = world.path("-cache")
    (root / "models").mkdir(parents=True)
    (root / "gguf").mkdir()
    foreign: list[Path] = []
    for _ in range(rng.randint(0, 4)):
        what = rng.choice(["user-model", "user-gguf", "link-dir", "link-file", "root-file", "cache-like"])
        if what == "user-model":
            p = root / "models" / rng.choice(["my-finetune", "mine-0123456789ab", ".hidden-model"])
            p.mkdir(exist_ok=True)
            (p / "model.safetensors").write_bytes(b"mine")
            old = time.time() - rng.choice([0, 3 * 86400])
            os.utime(p, (old, old))
        elif what == "user-gguf":
            p = root / "gguf" / rng.choice(["my.gguf", "Qwen.gguf.123.partial", "x-0123456789ab.bin"])
            p.write_bytes(b"mine")
        elif what == "link-dir":
            p = root / "models" / rng.choice([".x-0123456789ab.pid1.abcdefgh", "y-0123456789ab"])
            if not p.exists():
                p.symlink_to(sentinel(world) / "models" / "precious", target_is_directory=True)
        elif what == "link-file":
            p = root / "gguf" / "Q-0123456789ab.gguf"
            if not p.exists():
                p.symlink_to(sentinel(world) / "own.gguf")
        elif what == "root-file":
            p = root / rng.choice(["notes.txt", "models.bak", "heads.txt"])
            p.write_text("mine", encoding="utf-8")
        else:  # a leftover with the cache's own name: may go, and is not guarded
            p = root / "models" / f".t-0123456789ab.pid{rng.choice([1, 999999])}.abcdefgh"
            p.mkdir(exist_ok=True)
            continue
        foreign.append(p)
    if rng.random() < 0.5:
        (root / TAG).write_text(TAG_TEXT, encoding="utf-8")
    if rng.random() < 0.1:
        shutil.rmtree(root)
        root.write_text("a file where the cache should be", encoding="utf-8")
        foreign = [root]
    action = rng.choice([["cache", "info"], ["cache", "clean"], ["cache", "clean", "--all"], ["cache", "verify"]])
    before = tree_hash(sentinel(world))
    guards = {p: tree_hash(p) if p.is_dir() and not p.is_symlink() else _file_hash(p) for p in foreign}
    old = os.environ.get("SPECDEC_CACHE_DIR")
    os.environ["SPECDEC_CACHE_DIR"] = str(root)
    try:
        o = run_in_process("cache", action)
        if rng.random() < 0.5:
            from engine.models.cache_space import sweep

            with contextlib.redirect_stderr(io.StringIO()):  # its one warning line is expected here
                sweep(root)
    finally:
        os.environ["SPECDEC_CACHE_DIR"] = old or ""
    return with_outside_check(o, world, before, guards)


# --------------------------------------------------------------------------- work folders

_TARGET: list = []  # the tiny target and its tokenizer, loaded once


class _Payload:
    """Unpickling it writes into the sentinel folder: what a planted pickle would do with a shell command."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def world_distiller(world: World, work: Path, out: Path):
    """A distillation of the world's tiny target (loaded once) with a one-round, one-step plan."""
    from engine.heads.distill import Distiller, DistillPlan
    from engine.heads.train import TrainConfig

    if not _TARGET:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(world.target)
        _TARGET.append((AutoModelForCausalLM.from_pretrained(world.target).eval().requires_grad_(False), tok))
    model, tok = _TARGET[0]
    plan = DistillPlan(minutes=60, question_batch=4, question_tokens=8, answer_tokens=8, intermediate=16,
                       draft_vocab=64, eval_sequences=2, eval_every_s=1e9, checkpoint_every_s=1e9, log_every=1,
                       max_rounds=1, max_steps=1, questions_must_end=False,
                       train=TrainConfig(depth=2, batch_tokens=256, max_len=48))
    return Distiller(model, tok, work=work, out=out, plan=plan, name="fuzz head")


def work_case(rng: random.Random, world: World) -> Outcome:
    from engine.errors import EngineError

    work, out = world.path("-work"), world.path("-head")

    def distiller():
        return world_distiller(world, work, out)

    with contextlib.suppress(EngineError):
        d = distiller()
        if rng.random() < 0.5:
            d.state["phase"] = "train"
            d.state["rounds"] = 1
        d._save_state()
    payload = str(sentinel(world) / "pwned")
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(["data/round-00000.pt", "data/round-00001.pt", "checkpoint.pt", "vocab.pt", "state.json"])
        path = work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        what = rng.choice(["pickle", "junk", "empty", "wrong-shape", "json-junk"])
        if what == "pickle":
            path.write_bytes(pickle.dumps([_Payload(payload)]))
        elif what == "junk":
            path.write_bytes(os.urandom(rng.randint(1, 3000)))
        elif what == "empty":
            path.write_bytes(b"")
        elif what == "wrong-shape":
            import torch

            torch.save(rng.choice([[1, 2, 3], {"head": 5}, [{"question": 5}], "x", {"a": [1]}]), path)
        else:
            path.write_text(json.dumps(rng.choice(WRONG)), encoding="utf-8")

    def call() -> int:
        try:
            distiller().run()
        except EngineError as e:
            print(f"specdec-studio: error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
        return 0

    return run_call("work", f"work {work.name}", world, call)


# --------------------------------------------------------------------------- configs

SIZE_FIELDS = ["num_attention_heads", "hidden_size", "num_key_value_heads", "num_hidden_layers", "vocab_size",
               "intermediate_size", "head_dim", "max_position_embeddings"]


def config_case(rng: random.Random, world: World) -> Outcome:
    folder = world.path("-model")
    shutil.copytree(world.target, folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for _ in range(rng.randint(1, 2)):
        key = rng.choice(SIZE_FIELDS)
        if rng.random() < 0.15:
            config.pop(key, None)
        else:
            config[key] = rng.choice([0, -1, -4, -(2**40), "64", 2.5, None, True, [], 3, 10**6])
    if rng.random() < 0.05:
        config = rng.choice([[], "config", 5])
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if rng.random() < 0.4:  # another of the folder's JSON files damaged: read by the census, the loader, transformers
        _damage_model_json(rng, folder)
    argv = ["generate", "--target", str(folder), "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "2"]
    argv += rng.choice([["--draft", str(world.draft)], ["--mode", "standard"], ["--proposer", "ngram"]])
    before = tree_hash(sentinel(world))
    return with_outside_check(run_in_process("config", argv), world, before, {})


MODEL_JSON = ["config.json", "tokenizer_config.json", "generation_config.json", "tokenizer.json",
              "model.safetensors.index.json", "model.safetensors"]


def _damage_model_json(rng: random.Random, folder: Path) -> None:
    """One JSON file of a model folder (or the safetensors header, which is JSON) nested too deeply to read, of
    another type, or random bytes."""
    name = rng.choice(MODEL_JSON)
    text = rng.choice(["[" * 100_000 + "]" * 100_000, '{"a":' * 5000 + "1" + "}" * 5000, "[]", '"text"', "5", "null",
                       '{"weight_map": []}', '{"weight_map": {"x": 5}}'])
    data = os.urandom(rng.randint(0, 200)) if rng.random() < 0.15 else text.encode()
    if name == "model.safetensors":
        data = struct.pack("<Q", len(data)) + data
    (folder / name).write_bytes(data)


FILE_CASES = [("conversations", conversation_case), ("settings-foreign", settings_foreign_case),
              ("cache", cache_case), ("work", work_case), ("config", config_case)]
