"""`specdec-studio distill`: trains a draft head on the target's own answers (engine/heads/distill.py)."""
from __future__ import annotations

import argparse
import json
import sys

from app.cli.common import PROG, CliError


def cmd_distill(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.heads.distill import DistillPlan, check_init, check_out, distill, plan_with
    from engine.heads.fitting import DistillError
    from engine.heads.reuse import find_all_kept
    from engine.measure.bench import read_prompts

    # Cheap checks first: a typo in a file or folder name should not cost a model load.
    changes = dict(args.plan)
    try:
        plan_with(DistillPlan(), changes)
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        if args.init is not None:
            check_init(args.init)
        check_out(args.out, args.work or args.out / "work")
        find_all_kept(args.data, args.work or args.out / "work")
    except DistillError as e:
        raise CliError(str(e)) from None
    questions = [p.prompt for p in read_prompts(args.prompts)] if args.prompts is not None else []
    for folder in (args.out, args.work or args.out / "work"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CliError(f"cannot create {folder}: {e.strerror or e}") from None
    budget = args.minutes * 60
    with tqdm(total=round(budget), file=sys.stderr, desc="distill", unit="s", disable=None,
              bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s of the budget [{elapsed}<{remaining}] {postfix}") as bar:
        logged = {"train": 0}

        def progress(p) -> None:
            bar.update(max(0, round(p.fraction * budget) - bar.n))
            bar.set_postfix_str(p.message[:70])
            kind = p.record.get("kind") if p.record is not None else None
            if kind == "train":
                logged["train"] += 1
            # Without a terminal (a GPU job's log) the bar is off: the milestones and every 5th loss go to stderr.
            quiet = bar.disable and kind == "train" and logged["train"] % 5
            if (kind is not None and not quiet and (kind != "train" or bar.disable)) or args.verbose:
                bar.write(f"{PROG}: [{p.fraction:.0%}, {p.eta_s / 60:.1f} min left] {p.message}", file=sys.stderr)

        summary = distill(args.target, args.out, minutes=args.minutes, work=args.work, call_minutes=args.call_minutes,
                          device=args.device, dtype=args.dtype, seed=args.seed, questions=questions,
                          progress=progress, init=args.init, plan_changes=changes,
                          data=args.data)
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0
