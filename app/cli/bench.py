"""`specdec-studio bench`: modes timed side by side over a prompts file, as a table, JSON and CSV."""
from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from app.cli import common
from app.cli import options as opt
from app.cli.common import CliError
from app.core.export import cell
from app.core.session import runtime_label
from engine.measure.bench import MODE_RUNNERS

if TYPE_CHECKING:
    from engine.decoding import Engine


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.measure.bench import (
        BenchContext,
        RunRecord,
        format_table,
        parse_modes,
        read_prompts,
        result_json,
        run_bench,
    )
    from engine.models.loader import LoadedPair

    # Cheap checks first: a typo in a file name should not cost a model load.
    prompts = read_prompts(args.prompts)
    modes = parse_modes(args.modes)
    if "hf-assisted" in modes and args.proposer not in ("draft", "draft+ngram"):
        raise CliError("the hf-assisted baseline needs the draft model: use --proposer draft or drop that mode")
    outputs = [out for out in (args.json_out, args.csv_out) if out is not None]
    if len(outputs) == 2 and outputs[0].resolve() == outputs[1].resolve():
        raise CliError(f"--json and --csv name the same file {outputs[0]}")
    for out in outputs:
        try:
            opt.check_writable(out)
        except argparse.ArgumentTypeError as e:
            raise CliError(str(e)) from None
    needs_draft = any(MODE_RUNNERS[m].needs_draft for m in modes) and args.proposer in ("draft", "draft+ngram")
    engine = common.load_engine(args, needs_draft)
    # The hf-* baselines run on the engine's own torch models; on llama.cpp they load their own.
    pair = (LoadedPair(engine.target, engine.draft, engine.tokenizer, engine.info, engine.vocab)
            if engine.target is not None else None)
    ctx = BenchContext(
        pair, engine,
        make_request=lambda prompt, mode, max_new: common.request_for(args, prompt, mode, max_new),
        reload_pair=lambda: common.load_pair(args, needs_draft),
        # only standard runs there
        load_runtime=lambda runtime: common.load_engine(args, False, runtime, needs_head=False),
    )
    total = len(prompts) * len(modes) * args.repeat
    with tqdm(total=total, file=sys.stderr, desc="bench", unit="run", disable=None) as bar:
        def progress(done: int, _total: int, note: str) -> None:
            bar.set_postfix_str(note)
            bar.update(done - bar.n)

        result = run_bench(ctx, prompts, modes, max_new_tokens=args.max_new_tokens, warmup=args.warmup,
                           repeat=args.repeat, progress=progress, proposer=args.proposer)
    result.summary["diagnostics"] = diagnose(engine, args, result.summary)
    config = {**common.model_config(engine, args), "modes": list(result.modes), "prompts": str(args.prompts),
              "warmup": args.warmup, "repeat": args.repeat, "wall_s": result.wall_s, **common.environment(engine)}
    table = format_table(result.summary, result.modes)
    try:
        if args.json_out is not None:
            args.json_out.write_text(result_json(result, config), encoding="utf-8")
        if args.csv_out is not None:
            with open(args.csv_out, "w", newline="", encoding="utf-8") as f:
                names = [n for n in RunRecord.__dataclass_fields__ if n != "token_ids"]
                writer = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
                writer.writeheader()
                writer.writerows({k: cell(v) for k, v in asdict(r).items()} for r in result.runs)
    except OSError as e:
        # The table still goes to stdout, so a long run is not lost to a bad output path.
        print(table)
        where = e.filename or " or ".join(str(o) for o in outputs)  # a failed write() names no file
        raise CliError(f"cannot write results: {e.strerror or e} ({where})") from None
    print(f"{engine.info.target_name} / {engine.info.draft_name or '-'} on {engine.info.device} "
          f"({common.precisions(engine.info)}, {runtime_label(engine.info)}), {len(prompts)} prompts, "
          f"k={args.k or 'auto'}, "
          f"temperature={args.temperature}, max_new_tokens={args.max_new_tokens}")
    print(table)
    return 0


def diagnose(engine: Engine, args: argparse.Namespace, summary: dict[str, Any]) -> list[str]:
    """The troubleshooting rules on what this bench measured, as lines to print and keep in the JSON."""
    from engine.measure.diagnostics import diagnose, from_bench
    from engine.measure.explain import describe_diagnosis

    evidence = from_bench(summary, engine.info, k=args.k, temperature=args.temperature, proposer=args.proposer)
    return [" ".join(describe_diagnosis(d)) for d in diagnose(evidence)]
