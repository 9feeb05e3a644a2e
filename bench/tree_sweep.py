"""Which draft tree pays here? The head's chains, sibling trees and dynamic trees beside standard decoding, one load.

Loads the target and the draft head once (the CLI's model options), then runs every prompt in standard
decoding and in each tree configuration in turn (configurations alternated per prompt, after one untimed
generation of each on the first prompt), so each ratio is measured side by side in one process on the
same prompts. A configuration is `0`..`3` (a chain with that many alternatives beside each draft token)
or `dN` (a dynamic tree of N nodes, engine/heads/tree.py), with `@K` for a draft depth other than --k
(e.g. `d48@8`), and `:rows` for a dynamic tree walked as a GPU walks it, every row of the tree forward
processed and drawn at once (torch.multinomial), where the CPU's walk goes row by row on the host
(engine/decoding/host_walk.py; e.g. `d16@4,d16@4:rows` on a CPU measures what that walk buys).
Prints one row per configuration: tok/s, x standard, tokens per target forward,
acceptance by position, identical outputs (greedy); then where each configuration's steps spend their
time (experiment.round_split: the drafting and the verify as the device's events timed them, the host's
work between steps, and what lies outside every step) beside the drafting and verify priced at load,
which the cost model and the draft check use; and writes every run to --json. `auto` runs the engine's auto
mode (it chooses the proposer, K and the tree per round) beside the fixed configurations; each row also has
its ratio by prompt category. `--temperatures 0,0.7` runs the whole sweep at each temperature after the one
load, writing one file each (`{t}` in --json: `greedy`, `t07`).

    python3 bench/tree_sweep.py --target path/to/target --head path/to/head --trees 2,d32,d48,d64@8 --k 6 \\
        --json bench/results/h200_tree_sweep.json
    python3 bench/tree_sweep.py --target path/to/target --head path/to/head --trees d64@5,auto \\
        --temperatures 0,0.7 --json 'bench/results/h200_tree_sweep_{t}.json'
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.cli import options as opt  # noqa: E402
from app.cli.common import CliError, environment, load_engine, request_for  # noqa: E402
from app.cli.parser import build_parser  # noqa: E402
from engine.errors import EngineError  # noqa: E402


def parse_config(text: str, k: int) -> tuple[str, str, int, bool]:
    """'d48@8:rows' -> (label, tree, K, every row at once), each part checked as the CLI checks --tree and --k
    (ArgumentTypeError); 'auto' -> the engine's auto mode on its default tree."""
    if text.strip().lower() == "auto":
        return "auto", "auto", k, False
    shape, colon, walk = text.partition(":")
    if colon and walk != "rows":
        raise argparse.ArgumentTypeError(f"{text!r}: after ':' only 'rows' (walk every row at once)")
    tree, _, depth = shape.partition("@")
    if tree.strip().lower() == "auto":
        raise argparse.ArgumentTypeError(f"{text!r}: auto chooses K and its tree itself; give it as 'auto'")
    return text, opt.tree(tree), opt.k(depth) if depth else k, bool(colon)


def use_walk(every: bool) -> None:
    """Every row of a tree at once with multinomial draws (a GPU's way), or the device's own way."""
    from engine.decoding import sampling, verify

    verify.WALK_ON_HOST = () if every else ("cpu",)
    sampling.HOST_SAMPLING = () if every else ("cpu",)


def use_tree(engine, tree: str, frontier: int) -> None:
    if tree == "auto":
        engine.set_tree(None)  # the device's default tree, fitted to the costs measured at load
    elif tree.startswith("d"):
        engine.set_dynamic_tree(int(tree[1:]), frontier)
    else:
        engine.set_dynamic_tree(0)
        engine.set_tree(int(tree))


def result_paths(out: Path, temperatures: list[float]) -> list[Path]:
    """One results file per temperature: `{t}` in --json named for each (greedy, t07), needed for several."""
    if len(temperatures) == 1 and "{t}" not in str(out):
        return [out]
    if "{t}" not in str(out):
        raise argparse.ArgumentTypeError("with several --temperatures, --json names each file with {t} "
                                         "(e.g. results_{t}.json: greedy, t07)")
    return [Path(str(out).replace("{t}", "greedy" if t == 0 else "t" + f"{t:g}".replace(".", "")))
            for t in temperatures]


def identical_cell(same: dict, temperature: float) -> str:
    """Greedy outputs match standard's token for token (a mismatch is a fault); sampled ones differ by chance."""
    return f"{same['identical']:>6}/{same['compared']:<4}" if temperature == 0 else f"{'sampled':>11}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", required=True, help="configurations, e.g. 0,2,d32,d48@8,auto")
    ap.add_argument("--json", dest="out", type=Path, required=True)
    ap.add_argument("--temperatures", default=None,
                    help="run the sweep at each of these temperatures after one load (--json with {t})")
    own, rest = ap.parse_known_args(argv)
    try:
        args = build_parser().parse_args(["bench", "--proposer", "head", "--prompts", "assets/bench_prompts.jsonl",
                                          *rest])
    except CliError as e:
        print(f"tree_sweep: {e}", file=sys.stderr)
        return 2
    from engine.measure.experiment import read_prompts

    try:
        configs = [parse_config(c.strip(), args.k) for c in own.trees.split(",") if c.strip()]
        if not configs:
            raise argparse.ArgumentTypeError("--trees names no configuration")
        if len({c[0] for c in configs}) < len(configs):
            raise argparse.ArgumentTypeError(f"--trees lists a configuration twice: {own.trees!r}")
        temperatures = ([opt.temperature(t) for t in opt.temperature_list(own.temperatures).split(",") if t.strip()]
                        if own.temperatures is not None else [args.temperature])
        paths = result_paths(own.out, temperatures)
        for path in paths:
            opt.check_writable(path)  # before minutes of loading and runs
        prompts = read_prompts(Path(args.prompts))
        started = time.perf_counter()
        engine = load_engine(args, needs_draft=False, needs_head=True)
        for _, tree, _, _ in configs:  # each one set once before any run: one that cannot be says so now
            use_tree(engine, tree, args.tree_frontier)
    except (argparse.ArgumentTypeError, EngineError) as e:
        print(f"tree_sweep: {e}", file=sys.stderr)
        return 2
    print(f"loaded in {time.perf_counter() - started:.1f} s: {engine.info.fast_path}, head {engine.info.head_name}",
          flush=True)
    args.raw = False
    for temperature, path in zip(temperatures, paths):
        args.temperature = temperature
        sweep(engine, args, configs, prompts, path, rest)
        print(f"wrote {path} ({time.perf_counter() - started:.0f} s in all)", flush=True)
    return 0


def sweep(engine, args: argparse.Namespace, configs, prompts, out: Path, argv: list[str]) -> None:
    """Standard decoding and every configuration on every prompt at args.temperature; prints and writes `out`."""
    from engine.measure.bench import compare_outputs
    from engine.measure.experiment import by_category, record_run, round_split, totals

    def run(prompt, label: str, tree: str | None, k: int, every: bool = False):
        use_walk(every)
        if tree is not None:
            use_tree(engine, tree, args.tree_frontier)
        args.k = k
        mode = "standard" if tree is None else "auto" if tree == "auto" else "speculative"
        generation = engine.generate(request_for(args, prompt.prompt, mode, args.max_new_tokens))
        steps = list(generation)
        return record_run(generation, steps, prompt, label)

    print(f"\ntemperature {args.temperature:g}", flush=True)
    verify_ms, draft_ms = {}, {}  # each configuration's tree rounds as measured at its first use (ms by K)
    for label, tree, k, every in [("standard", None, 0, False), *configs]:  # untimed: first calls, graphs
        run(prompts[0], label, tree, k, every)
        verify_ms[label], draft_ms[label] = dict(engine.info.tree_ms), dict(engine.info.tree_draft_ms)
    runs = []
    for prompt in prompts:
        runs.append(run(prompt, "standard", None, 0))
        for label, tree, k, every in configs:
            runs.append(run(prompt, label, tree, k, every))
    base = totals([r for r in runs if r.mode == "standard"])
    categories = by_category(runs, ["standard", *(c[0] for c in configs)])
    rows = []
    print(f"{'config':<10}{'K':>3}{'tok/s':>9}{'x std':>8}{'tok/fwd':>9}{'identical':>11}  acceptance by position")
    print(f"{'standard':<10}{'':>3}{base['tokens_per_s']:>9.1f}{1:>8.2f}{base['tokens_per_target_forward']:>9.2f}")
    for label, tree, k, every in configs:
        t = totals([r for r in runs if r.mode == label])
        same = compare_outputs(runs, label, engine.tokenizer)
        row = {"config": label, "tree": tree, "k": k, "every_row_at_once": every, "tokens_per_s": t["tokens_per_s"],
               "vs_standard": t["tokens_per_s"] / base["tokens_per_s"],
               "tokens_per_target_forward": t["tokens_per_target_forward"],
               "per_position_acceptance": list(t["per_position_acceptance"]),
               "by_category": {name: c["vs_standard"][label] for name, c in categories.items()},
               "time_split": t["time_split"], "tree_verify_ms": verify_ms[label],
               "round_ms": round_split([r for r in runs if r.mode == label]),
               # priced at load for the engine's own walk: on a CPU the host's, also for a `:rows` configuration
               "priced_ms": {"draft": draft_ms[label].get(k), "verify": verify_ms[label].get(k),
                             "walk": "host" if engine.device.type == "cpu" else "rows"},
               "identical": same["identical"], "compared": same["compared"],
               "divergences": same["divergences"]}
        rows.append(row)
        print(f"{label:<10}{k if tree != 'auto' else '':>3}{row['tokens_per_s']:>9.1f}{row['vs_standard']:>8.2f}"
              f"{row['tokens_per_target_forward']:>9.2f}{identical_cell(same, args.temperature)}  "
              + " ".join(f"{a:.2f}" for a in row["per_position_acceptance"]), flush=True)
    print("\nx standard by category: " + ", ".join(categories))
    for row in rows:
        print(f"{row['config']:<14}" + " ".join(f"{v:.2f}" for v in row["by_category"].values()))
    std_ms = round_split([r for r in runs if r.mode == "standard"])
    print(f"\nms a step{'':<5}{'draft':>8}{'verify':>8}{'host':>8}{'outside':>9}{'in all':>8}   priced at load")
    print(f"{'standard':<14}{'':>8}{std_ms['verify']:>8.3f}{std_ms['host']:>8.3f}{std_ms['outside']:>9.3f}"
          f"{std_ms['all']:>8.3f}   verify {dict(engine.info.target_ms).get(1, float('nan')):.3f}")
    for row in rows:
        m, p = row["round_ms"], row["priced_ms"]
        priced = "" if p["verify"] is None or row["tree"] == "auto" else (
            f"verify {p['verify']:.3f}" + ("" if p["draft"] is None else f" + draft {p['draft']:.3f}")
            + (" (for the host's walk)" if row["every_row_at_once"] and p["walk"] == "host" else ""))
        print(f"{row['config']:<14}{m['draft']:>8.3f}{m['verify']:>8.3f}{m['host']:>8.3f}{m['outside']:>9.3f}"
              f"{m['all']:>8.3f}   {priced}")
    out.write_text(json.dumps({
        "standard": {"tokens_per_s": base["tokens_per_s"], "tokens_per_target_forward": base["tokens_per_target_forward"]},
        "configs": rows, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
        "prompts": str(args.prompts), "argv": argv, "fast_path": engine.info.fast_path,
        "tree_frontier": args.tree_frontier, "target_ms": dict(engine.info.target_ms),
        "head_ms": engine.info.head_ms, "environment": environment(engine),
        # Each run's figures; its text and ids are left out (the divergences above name where outputs differ).
        "runs": [{k: v for k, v in asdict(r).items() if k not in ("text", "token_ids")} for r in runs]},
        indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
