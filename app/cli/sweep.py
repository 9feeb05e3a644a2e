"""`specdec-studio sweep`: proposer x K x temperature on the engine's sweep, written as CSV, JSON and a PNG."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.cli import common
from app.cli import options as opt
from app.cli.common import CliError
from app.core.session import build_request
from engine.limits import DEFAULT_K, K_AUTO
from engine.settings import GenerationSettings
from engine.types import GenerationRequest, Message

if TYPE_CHECKING:
    from engine.decoding import Engine


def cmd_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.measure import sweep as sw
    from engine.measure.bench import read_prompts

    # Cheap checks first: a typo in a list should not cost a model load.
    prompts = read_prompts(args.prompts)
    ks = sw.parse_list(args.ks, sw.parse_k, "k")
    temperatures = sw.parse_list(args.temperatures, float, "temperature")
    proposers = sw.parse_list(args.proposers, str, "proposer")
    configs = sw.plan(proposers, ks, temperatures, auto=args.auto)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"cannot create {args.out}: {e.strerror or e}") from None
    for name in ("sweep.csv", "sweep.json"):  # found now, not after the whole sweep
        try:
            opt.check_writable(args.out / name)
        except argparse.ArgumentTypeError as e:
            raise CliError(str(e)) from None
    args.k = DEFAULT_K  # only for the compiled fast path's choice of widths
    engine = common.load_engine(args, sw.needs_draft(configs), needs_head=any(c.proposer == "head" for c in configs))
    raw = args.raw

    def make_request(prompt: str, config: sw.SweepConfig, max_new: int) -> GenerationRequest:
        settings = GenerationSettings(mode=config.mode, proposer=config.proposer or "draft", k=config.k,
                                      temperature=config.temperature, max_new_tokens=max_new, system_prompt="")
        return build_request(settings, (), prompt=prompt) if raw else build_request(settings, (Message("user", prompt),))

    total = len(prompts) * len(configs) * args.repeat
    with tqdm(total=total, file=sys.stderr, desc="sweep", unit="run", disable=None) as bar:
        def progress(done: int, _total: int, record) -> None:
            bar.set_postfix_str(f"{record.prompt_id} {record.mode}")
            bar.update(done - bar.n)

        records = sw.run_sweep(engine, prompts, configs, make_request=make_request,
                               max_new_tokens=args.max_new_tokens, repeat=args.repeat, progress=progress)
    rows = sw.rows(records, configs, engine.info)
    categories = sw.category_speedups(records, configs)
    lines = _sweep_diagnoses(engine, rows, categories, configs)
    csv_path, png_path, json_path = args.out / "sweep.csv", args.out / "sweep.png", args.out / "sweep.json"
    try:
        sw.write_csv(csv_path, rows)
        json_path.write_text(json.dumps({
            "config": {**_model_config_sweep(engine, args), **common.environment(engine)},
            "rows": [sw.csv_row(r) for r in rows], "categories": categories, "diagnostics": lines,
            "runs": [{**asdict(r), "token_ids": list(r.token_ids)} for r in records],
        }, indent=2, ensure_ascii=False), encoding="utf-8")
    except OSError as e:
        print(sw.format_rows(rows))
        raise CliError(f"cannot write results: {e.strerror or e} ({e.filename})") from None
    png_note = _write_png(rows, png_path)
    info = engine.info
    print(f"{info.target_name} / {info.draft_name or '-'} on {info.device} ({info.dtype}, {info.fast_path}), "
          f"{len(prompts)} prompts x {args.repeat}, max_new_tokens={args.max_new_tokens}")
    print(sw.format_rows(rows))
    top = sw.best(rows, fixed_only=True)
    shown = [c.label for c in configs if c.mode == "auto" or c.k == K_AUTO]
    shown += [sw.label_of(top, configs)] if top is not None and top.mode != "standard" else []
    for label in shown:
        if len(categories.get(label, {})) > 1:
            print(f"per category, {label} over standard: "
                  + ", ".join(f"{cat} {x:.2f}x" for cat, x in categories[label].items()))
    for line in lines:
        print(f"diagnosis: {line}")
    print(f"wrote {csv_path}, {json_path}{png_note}")
    return 0


def _model_config_sweep(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    info = engine.info
    return {"target": info.target_name, "draft": info.draft_name, "device": info.device, "dtype": info.dtype,
            "fast_path": info.fast_path, "ks": args.ks, "temperatures": args.temperatures,
            "proposers": args.proposers, "auto": args.auto, "repeat": args.repeat,
            "max_new_tokens": args.max_new_tokens, "prompts": str(args.prompts),
            "target_ms": dict(info.target_ms), "proposer_costs": [asdict(c) for c in info.proposer_costs],
            "measure_s": info.measure_s}


def _sweep_diagnoses(engine: Engine, rows, categories: dict[str, dict[str, float]], configs) -> list[str]:
    from engine.measure import sweep as sw
    from engine.measure.diagnostics import Evidence, diagnose
    from engine.measure.explain import describe_diagnosis

    top = sw.best(rows, fixed_only=True)  # where does the best fixed configuration lose?
    per_category = categories.get(sw.label_of(top, configs), {}) if top is not None and top.mode != "standard" else {}
    evidence = Evidence(sweep=tuple(rows), info=engine.info,
                        categories=tuple(per_category.items()) if len(per_category) > 1 else ())
    return [" ".join(describe_diagnosis(d)) for d in diagnose(evidence)]


def _write_png(rows, path: Path) -> str:
    """The plot, rendered offscreen with the Tune tab's own charts; skipped (and said) where Qt is missing."""
    from widgets.tune.sweep_png import write_sweep_png

    try:
        write_sweep_png(rows, path)
    except ImportError as e:  # a GPU box without PySide6: the CSV and JSON hold every figure
        return f" (no {path.name}: {e.name or 'PySide6'} is not installed)"
    except OSError as e:
        return f" (no {path.name}: {e})"
    return f", {path}"
