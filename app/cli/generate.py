"""`specdec-studio generate`: one answer, streamed to stdout (or as one JSON object)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from app.cli import common
from app.cli.common import PROG
from app.core.session import runtime_label
from engine.types import PrefillProgress
from engine.measure.explain import describe_prefill


def cmd_generate(args: argparse.Namespace) -> int:
    needs_draft = args.mode != "standard" and args.proposer in ("draft", "draft+ngram")
    engine = common.load_engine(args, needs_draft, keep_costs=True)
    generation = engine.generate(common.request_for(args, args.prompt, args.mode, args.max_new_tokens),
                                 progress=_show_prefill if sys.stderr.isatty() and not args.json else None)
    tokens: list[dict[str, str | int | None]] = []
    for step in generation:
        if args.json:  # branch: a tree round's rank among the drafter's choices (None for chains and target tokens)
            tokens.extend({"text": t.text, "status": t.status, "branch": t.branch} for t in step.tokens)
        else:
            sys.stdout.write(step.text)
            sys.stdout.flush()
    summary = generation.summary
    assert summary is not None, "a finished generation has a summary"
    if args.json:
        out = {"text": summary.text, "tokens": tokens, "summary": asdict(summary),
               "config": {**common.model_config(engine, args), "mode": args.mode, **common.environment(engine)}}
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        info = engine.info
        print(f"{common.summary_line(summary)}; {info.device}, {common.precisions(info)}, {runtime_label(info)}",
              file=sys.stderr)
        if info.fast_path_note:
            print(f"{PROG}: {info.fast_path_note}", file=sys.stderr)
    return 0


def _show_prefill(progress: PrefillProgress) -> None:
    """A long prompt's progress on the terminal, on one line that the answer's first token follows."""
    end = "\n" if progress.done == progress.total else ""
    print(f"\r{describe_prefill(progress)}", end=end, file=sys.stderr, flush=True)
