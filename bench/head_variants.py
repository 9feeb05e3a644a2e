"""Would a wider draft vocabulary or a second decoder layer pay? What each costs a draft step, against what it must win.

Loads the target and its draft head (default: the shipped one), then on this machine:
  1. The vocabulary's ceiling. Decodes --prompts greedily (standard decoding) and counts the answer tokens
     outside the head's draft vocabulary: the head can never draft those, so a wider vocabulary can raise
     acceptance at a draft position by at most that share (a full vocabulary by all of it).
  2. The draft step's cost (HeadRunner.measure_ms: a round's milliseconds per draft token, catch-up and
     chain steps, CUDA graphs on a GPU; the median of --passes passes, the variants in turn in each) with
     the head's own output rows, twice as many and the target's whole vocabulary (the extra rows are target
     rows of the same shape and dtype; their values do not change the time), and with a second decoder
     layer (the head grown a layer: DraftHead.grown).
  3. What each must win. With the verify costs the engine measured at load (every width) and the head's
     held-out acceptance by position (its manifest), the best chain's predicted speedup now, and for each
     variant the rise in acceptance at every position it needs to match it: a variant pays only where
     training lifts acceptance by more than that (for the vocabulary, more than its ceiling cannot be had).

CPU, real default pair and shipped head:

    flock /tmp/specdec-real.lock .venv/bin/python bench/head_variants.py --prompts 20 --max-new-tokens 64 \\
        --json bench/results/cpu_head_variants.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_record  # noqa: E402

K_MAX = 8  # chains priced up to this K (the widths the engine measures at load)


def chain_speedup(acceptance: list[float], target_ms: dict[int, float], draft_ms: float) -> tuple[float, int]:
    """(speedup, K) of the best chain over the measured verify widths, as the cost model prices one
    (CostModel.speedup_from_positions); K = 0 is standard (1.0)."""
    from engine.measure.costmodel import CostModel

    model = CostModel(draft_ms=draft_ms, target_ms=target_ms)
    ks = [k for k in range(1, K_MAX + 1) if k + 1 in target_ms]
    return max([(1.0, 0)] + [(model.speedup_from_positions(acceptance, k), k) for k in ks])


def needed_rise(acceptance: list[float], target_ms: dict[int, float], draft_ms: float, now: float) -> float | None:
    """The rise in acceptance at every position (added, capped at 1) a drafter of `draft_ms` needs to reach the
    speedup `now`; None when even acceptance 1 everywhere does not reach it."""
    lifted = lambda d: [min(a + d, 1.0) for a in acceptance]  # noqa: E731
    if chain_speedup(lifted(1.0), target_ms, draft_ms)[0] < now:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if chain_speedup(lifted(mid), target_ms, draft_ms)[0] < now else (low, mid)
    return high


def variant_head(head, rows: int, target):
    """The head's weights with `rows` output rows: its own first, then other target ids (their rows taken from
    the target's input embeddings, the same shape and dtype as output rows)."""
    import torch

    from engine.heads.model import DraftHead

    if rows == head.config.draft_vocab:
        return head
    embed = target.get_input_embeddings().weight
    others = torch.ones(embed.shape[0], dtype=torch.bool, device=head.d2t.device)
    others[head.d2t] = False
    extra = others.nonzero().flatten()[: rows - head.config.draft_vocab]
    d2t = torch.cat([head.d2t, extra])
    variant = DraftHead(replace(head.config, draft_vocab=rows), d2t.cpu())
    variant.load_state_dict({k: v for k, v in head.state_dict().items() if k != "d2t"}, strict=False)
    variant = variant.to(device=head.lm_rows.device, dtype=head.fc.dtype).eval().requires_grad_(False)
    variant.bind_inputs(target)
    variant.lm_rows = torch.cat([head.lm_rows, embed[extra].to(head.lm_rows.dtype)]).contiguous()
    variant.lm_bias = None if head.lm_bias is None else torch.cat([head.lm_bias, head.lm_bias.new_zeros(len(extra))])
    return variant


def two_layers(head, target):
    """The head grown a second decoder layer (its own cache; the new layer starts as the identity), bound to the
    same output rows."""
    grown = head.grown(2).eval().requires_grad_(False)
    grown.bind_inputs(target)
    grown.lm_rows, grown.lm_bias = head.lm_rows, head.lm_bias
    return grown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20, help="first N prompts of the prompt file (0: skip step 1)")
    ap.add_argument("--prompt-file", type=Path, default=Path("assets/bench_prompts.jsonl"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--target", default=None, help="a target folder (default: the packaged pair's)")
    ap.add_argument("--head", default="auto", help="a head folder (default: the shipped head for the target)")
    ap.add_argument("--iters", type=int, default=0, help="timed draft rounds per figure (default: 20 CPU, 200 GPU)")
    ap.add_argument("--passes", type=int, default=5, help="each variant timed this many times in turn (the median)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here (a bench record)")
    args = ap.parse_args(argv)
    if args.prompts < 0 or args.max_new_tokens < 1 or args.iters < 0 or args.passes < 1:
        print("head_variants: --prompts and --iters take 0 or more, --max-new-tokens and --passes 1 or more",
              file=sys.stderr)
        return 2
    if args.json is not None and args.json.is_dir():
        print(f"head_variants: --json {args.json} is a folder; name a file", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[1]
    prompt_file = args.prompt_file if args.prompt_file.is_absolute() else root / args.prompt_file
    try:
        lines = [json.loads(line) for line in prompt_file.read_text("utf-8").splitlines() if line.strip()]
        prompts = [str(item["prompt"]) for item in lines][: args.prompts]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"head_variants: cannot read prompts from {prompt_file}: {e}", file=sys.stderr)
        return 2

    import torch

    from engine.assemble import engine_for_pair, load_pair_packed
    from engine.errors import EngineError
    from engine.heads.runner import HeadRunner
    from engine.heads.shards import head_for, read_manifest
    from engine.loadspec import LoadSpec
    from engine.types import GenerationRequest, Message, Sampling

    started = time.perf_counter()
    try:
        engine = engine_for_pair(load_pair_packed(LoadSpec(args.target, None, with_draft=False, head=args.head)),
                                 LoadSpec())
        files = head_for(engine.target) if args.head == "auto" else read_manifest(Path(args.head))
    except (EngineError, OSError) as e:
        print(f"head_variants: {e}", file=sys.stderr)
        return 2
    if engine.head_runner is None or files is None:
        print("head_variants: no draft head fits this target (--head DIR)", file=sys.stderr)
        return 2
    head = engine.head_runner.head
    if head.kind is not None:
        print(f"head_variants: the head runs in {head.kind}; measure it in float (no --quant)", file=sys.stderr)
        return 2
    acceptance = [float(a) for a in files.manifest.get("training", {}).get("held_out_acceptance", [])]
    if not acceptance:
        print("head_variants: the head's manifest has no held-out acceptance", file=sys.stderr)
        return 2
    gpu = engine.device.type == "cuda"
    iters = args.iters or (200 if gpu else 20)
    own = head.config.draft_vocab
    vocab = int(engine.target.get_input_embeddings().weight.shape[0])

    # 1. the vocabulary's ceiling: answer tokens the head cannot draft
    answers, outside = 0, 0
    d2t = set(head.d2t.tolist())
    for prompt in prompts:
        request = GenerationRequest(messages=(Message("user", prompt),), mode="standard", sampling=Sampling(),
                                    max_new_tokens=args.max_new_tokens)
        ids = [s.added for s in engine.generate(request) if s.added is not None]
        answers += len(ids)
        outside += sum(t not in d2t for t in ids)
    ceiling = outside / answers if answers else None

    # 2. the draft step's cost with more output rows, and with a second layer
    if not engine.info.target_ms:
        engine.measure_costs()
    target_ms = {int(w): float(ms) for w, ms in engine.info.target_ms}
    heads = {"today": head}
    for rows in sorted({min(2 * own, vocab), vocab} - {own}):
        heads[f"{rows:,} output rows"] = variant_head(head, rows, engine.target)
    heads["two decoder layers"] = two_layers(head, engine.target)
    timed: dict[str, list[float]] = {name: [] for name in heads}
    with torch.no_grad():
        runners = {name: HeadRunner(variant, max_length=1024, k_max=K_MAX) for name, variant in heads.items()}
        for runner in runners.values():
            runner.warmup()
        for _ in range(args.passes):  # the variants in turn, each pass: side by side as the machine drifts
            for name, runner in runners.items():
                timed[name].append(runner.measure_ms(5, iters))
    costs = {name: statistics.median(ms) for name, ms in timed.items()}

    # 3. what each must win
    now, k_now = chain_speedup(acceptance, target_ms, costs["today"])
    rows_out = []
    for name, cost in costs.items():
        if name == "today":
            continue
        rise = needed_rise(acceptance, target_ms, cost, now)
        rows_out.append({"variant": name, "draft_ms": round(cost, 4), "cost_over_now": round(cost / costs["today"], 3),
                         "needed_rise": None if rise is None else round(rise, 4)})

    std = target_ms[1]
    print(f"device {engine.device} ({engine.info.dtype}); standard step {std:.2f} ms; head {files.name}, "
          f"{own:,} rows of {vocab:,}")
    if ceiling is not None:
        print(f"vocabulary ceiling: {outside} of {answers:,} greedy answer tokens ({ceiling:.2%}) lie outside the "
              f"head's {own:,} rows: no wider vocabulary can raise acceptance at a position by more")
    print(f"held-out acceptance by position {' '.join(f'{a:.2f}' for a in acceptance)}: best chain K={k_now}, "
          f"{now:.2f}x predicted at a draft token of {costs['today']:.3f} ms ({costs['today'] / std:.1%} of a "
          "standard step)")
    print(f"{'variant':<26}{'ms a draft token':>18}{'x now':>8}   acceptance rise needed at every position"
          f"   (passes, ms)")
    for r in rows_out:
        need = "cannot reach it" if r["needed_rise"] is None else f"+{r['needed_rise']:.3f}"
        spread = " ".join(f"{x:.2f}" for x in timed[r["variant"]])
        print(f"{r['variant']:<26}{r['draft_ms']:>18.3f}{r['cost_over_now']:>8.2f}   {need:<15}({spread})")
    print(f"today's head, passes: {' '.join(f'{x:.2f}' for x in timed['today'])} ms")
    if args.json is not None:
        summary = {"device": str(engine.device), "dtype": engine.info.dtype, "head": files.name,
                   "draft_vocab": own, "target_vocab": vocab, "answer_tokens": answers, "outside_vocab": outside,
                   "vocab_ceiling": ceiling, "held_out_acceptance": acceptance, "target_ms": target_ms,
                   "draft_ms": {k: round(v, 4) for k, v in costs.items()},
                   "draft_ms_passes": {k: [round(x, 4) for x in v] for k, v in timed.items()},
                   "best_k": k_now, "predicted_speedup": round(now, 4),
                   "variants": rows_out, "seconds": round(time.perf_counter() - started, 1)}
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        write_record(args.json, config, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
