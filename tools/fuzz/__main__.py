"""`python -m tools.fuzz`: the fuzzer's command line, its run and its report (see tools/fuzz/core.py)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tools.fuzz.cases import cli_argv, gguf_case, prompts_case, settings_case
from tools.fuzz.core import (
    MEMORY_LIMIT,
    Outcome,
    World,
    _StderrProxy,
    build_world,
    dismiss_dialogs,
    run_in_process,
    run_subprocess,
    use_tiny_defaults,
)
from tools.fuzz.files import FILE_CASES as OTHER_FILE_CASES
from tools.fuzz.files import sentinel, tree_hash
from tools.fuzz.heads import head_case

FILE_CASES = [*OTHER_FILE_CASES, ("head", head_case)]  # crafted files, each run as one case in turn

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
    p.add_argument("--crafted", type=int, default=500, help="crafted conversations, settings, cache and work "
                                                            "folders, configs (files.py), run in this process")
    p.add_argument("--processes", type=int, default=40, help="cases run as real subprocesses (a sample of both)")
    p.add_argument("--no-memory-limit", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    p.add_argument("--json", type=Path, default=None, help="write every failure and the counts here")
    args = p.parse_args(argv)

    if not args.no_memory_limit:
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
    outside_before = tree_hash(sentinel(world))
    file_makers = [("gguf", gguf_case), ("prompts", prompts_case), ("settings", settings_case)]
    plan = ([("cli", None)] * args.cases + [file_makers[i % 3] for i in range(args.files)]
            + [FILE_CASES[i % len(FILE_CASES)] for i in range(args.crafted)])
    rng.shuffle(plan)  # the kinds interleave: one case's leftovers meet the next kind's
    crafted = {kind for kind, _ in FILE_CASES}
    for n, (kind, maker) in enumerate(plan, 1):
        if kind in crafted:
            outcomes.append(maker(rng, world))
        else:
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
    outside = int(tree_hash(sentinel(world)) != outside_before)  # the whole run, on top of every case's own check
    failures = [o for o in outcomes if o.problems]
    report(outcomes, failures, time.perf_counter() - started, outside)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "seed": args.seed, "cases": len(outcomes), "failures": [
                {"kind": o.kind, "where": o.where, "argv": [a if isinstance(a, str) else repr(a) for a in o.argv],
                 "rc": o.rc, "problems": o.problems, "stderr_tail": o.err[-1500:]} for o in failures],
            "counts": {**summary_counts(outcomes), "outside_changes": outside + sum(
                any(p.startswith("outside change") for p in o.problems) for o in outcomes)}},
            indent=2, ensure_ascii=False), encoding="utf-8")
    if args.keep:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures or outside else 0


def summary_counts(outcomes: list[Outcome]) -> dict:
    return {
        "by_kind": dict(Counter(f"{o.kind} ({o.where})" for o in outcomes)),
        "exit_codes": dict(Counter(str(o.rc) for o in outcomes)),
        "problems": dict(Counter(p.split(":")[0].split(" (")[0] for o in outcomes for p in o.problems)),
    }


def report(outcomes: list[Outcome], failures: list[Outcome], seconds: float, outside: int = 0) -> None:
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
    changed = outside + sum(any(p.startswith("outside change") for p in o.problems) for o in outcomes)
    print(f"tracebacks: {tracebacks}, hangs: {hangs}, exits other than 0 and 2: {others}, "
          f"outside changes: {changed}, cases with any problem: {len(failures)}")
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
