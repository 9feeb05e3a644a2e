"""`specdec-studio plan`: the memory plan of a pair, offline (configs and headers only)."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from app.cli import common


def cmd_plan(args: argparse.Namespace) -> int:
    """Prints the memory plan (offline: configs and headers only); exit 1 when it does not fit."""
    from engine.models.plan import format_plan
    from engine.models.planner import plan_pair, preset_table

    if args.presets:
        print(preset_table(device="cuda", memory=args.memory, context=args.context, gpus=args.gpus))
        return 0
    target, draft = common.pair_specs(args)
    plan = plan_pair(target, draft, with_draft=not args.no_draft, device=args.device, dtype=args.dtype,
                     target_precision=args.target_dtype, draft_precision=args.draft_dtype, context=args.context,
                     memory=args.memory, gpus=args.gpus, head=args.head, sequences=args.max_seqs)
    if args.json:
        print(json.dumps(asdict(plan) | {"fits": plan.fits}, indent=2))
    else:
        print(format_plan(plan))
    return 0 if plan.fits else 1
