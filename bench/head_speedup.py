"""How much faster than standard decoding does the draft head decode? Greedy and T = 0.7, figures printed.

A thin shell over `specdec-studio bench`: one bench per setting (standard and the head's
speculative decoding side by side, 20 prompts), each written as a bench record to --out, then one
table. Optional sweeps time more K values (--sweep) and tree widths (--trees, alternatives per
draft token; 0 = chains), one bench each (every bench loads the target again).

    python bench/head_speedup.py --target path/to/Qwen2.5-Coder-1.5B-Instruct --out results/
    python bench/head_speedup.py --target path/to/Qwen2.5-Coder-1.5B-Instruct --fast-path compiled --out results/
    python bench/head_speedup.py --target path/to/Qwen2.5-Coder-1.5B-Instruct --dtype float32 --temperatures 0 --out results/
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from record import read_record  # noqa: E402


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def bench(args: argparse.Namespace, label: str, *, temperature: str, k: str, tree: str, modes: str) -> dict:
    """Runs one `specdec-studio bench` in this process and returns its record."""
    from app.main import main as cli

    out = args.out / f"head_{label}.json"
    argv = ["bench", "--prompts", args.prompts, "--modes", modes, "--proposer", "head", "--head", args.head,
            "--k", k, "--tree", tree, "--temperature", temperature, "--max-new-tokens", str(args.max_new_tokens),
            "--fast-path", args.fast_path, "--dtype", args.dtype, "--device", args.device, "--json", str(out)]
    if args.target:
        argv += ["--target", args.target]
    print(f"\n=== {label}: specdec-studio {' '.join(argv)}", flush=True)
    code = cli(argv)
    if code != 0:
        raise SystemExit(code)
    return read_record(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="the target (default: the packaged pair's)")
    ap.add_argument("--head", default="auto", help="head folder, or auto: the shipped head for this target")
    ap.add_argument("--prompts", default="assets/bench_prompts.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--k", default="5")
    ap.add_argument("--tree", default="auto", help="alternatives per greedy draft token in the main runs")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--sweep", default="", help="more K values, greedy, head only (e.g. 3,4,6,7,8)")
    ap.add_argument("--trees", default="", help="tree widths to time, greedy, head only (e.g. 0,1,2,3)")
    ap.add_argument("--fast-path", default="auto", choices=["auto", "eager", "static", "compiled"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, required=True, help="folder for the bench records")
    args = ap.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, dict, dict | None]] = []  # label, the head's summary, standard's summary
    for t in _csv(args.temperatures):
        label = f"t{t.replace('.', '')}"
        s = bench(args, label, temperature=t, k=args.k, tree=args.tree, modes="standard,speculative")["summary"]
        rows.append((f"T={t} K={args.k}", s, s.get("standard")))
    greedy_standard = rows[0][2] if rows else None
    for k in _csv(args.sweep):
        s = bench(args, f"k{k}", temperature="0", k=k, tree=args.tree, modes="speculative")["summary"]
        rows.append((f"T=0 K={k}", s, greedy_standard))
    for tree in _csv(args.trees):
        s = bench(args, f"tree{tree}", temperature="0", k=args.k, tree=tree, modes="speculative")["summary"]
        rows.append((f"T=0 K={args.k} tree {tree}", s, greedy_standard))

    print(f"\n{'run':<22}{'standard':>10}{'head':>9}{'x std':>8}{'tok/fwd':>9}  acceptance by position")
    for label, s, standard in rows:
        spec = s["speculative"]
        std = standard["tokens_per_s"] if standard else float("nan")
        print(f"{label:<22}{std:>10.1f}{spec['tokens_per_s']:>9.1f}{spec['tokens_per_s'] / std:>8.2f}"
              f"{spec['tokens_per_target_forward']:>9.2f}  "
              + " ".join(f"{a:.2f}" for a in spec.get("per_position_acceptance", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
