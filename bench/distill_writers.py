"""Which writer answers the distillation's questions faster: Hugging Face's batched generate or continuous batching.

The same questions, answered greedily by the target with the chat template distill uses, by each writer in
one process (each warmed first, then timed in turn):

- `generate`: D.sample_segmented, Hugging Face's generate over left-padded batches of `--batch` questions,
  in segments of `--segment` tokens (rows that ended drop out between segments), as distill wrote data
  with `--plan rows=0`;
- `continuous R`: engine/heads/generate.py with R rows (distill's default writer, `--plan rows=R`), its step of
  every row replayed as CUDA graphs on a GPU; `--eager` also times the last R with that step launched
  eagerly, op by op (`continuous R eager`).

Prints answer tokens per second of each, the ratio to the first writer timed (generate unless
`--no-generate`), and how many answers are the same as that writer's token for token (bf16 kernels may
round a near tie differently for another batch shape):

    python bench/distill_writers.py --target path/to/Qwen2.5-Coder-1.5B-Instruct --json distill_writers.json

Where the continuous writer's time goes: `--profile` runs the last row count once more under torch's
profiler and prints the operations that took the most device time (CPU time on a CPU), with the share
of the device time each took and how busy the device was over the run; `--no-generate` leaves generate
out (ratios are then to the first writer).

    python bench/distill_writers.py --target path/to/Qwen2.5-Coder-1.5B-Instruct --rows 512 --no-generate --eager --profile
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_data_speed import questions  # noqa: E402
from record import write_record  # noqa: E402

from app.cli import options as opt  # noqa: E402


def count(what: str, high: int):
    """An argparse type: a whole number from 1 to `high` (the CLI's own check)."""
    return lambda text: opt.whole(text, 1, high, what)


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.heads import data as D
    from engine.heads.generate import ContinuousSampler

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, type=opt.path, help="a Hugging Face model folder")
    ap.add_argument("--json", type=Path, default=None, help="write the figures as a bench record")
    ap.add_argument("--device", default="cuda", type=opt.device)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--questions", type=count("--questions", 100_000), default=512)
    ap.add_argument("--answer-tokens", type=count("--answer-tokens", 16384), default=512)
    ap.add_argument("--batch", type=count("--batch", 16384), default=512, help="rows of one generate call")
    ap.add_argument("--segment", type=lambda t: opt.whole(t, 0, 16384, "--segment"), default=128,
                    help="generate's segment (0: one call)")
    ap.add_argument("--rows", default="128,256,512", type=lambda t: opt.listed(t, count("--rows", 8192), "--rows"),
                    help="continuous batching row counts")
    ap.add_argument("--no-generate", action="store_true", help="time only the continuous writer")
    ap.add_argument("--eager", action="store_true",
                    help="also time the last row count with its step launched eagerly (no CUDA graphs)")
    ap.add_argument("--profile", action="store_true",
                    help="profile the last row count's writer and print where its time goes")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.exit(2, f"distill_writers: {args.device} asked, and this torch sees no CUDA device\n")
    if not (args.target / "config.json").is_file():
        ap.exit(2, f"distill_writers: {args.target} is not a Hugging Face model folder (no config.json)\n")
    try:
        tok = AutoTokenizer.from_pretrained(args.target)
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype))
        model = model.to(args.device).eval()
    except (OSError, ValueError, RuntimeError) as e:
        ap.exit(2, f"distill_writers: cannot load {args.target} on {args.device}: {str(e).splitlines()[0]}\n")
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    prompts = sorted((D.answer_prompt(tok, q, None) for q in questions(args.questions)), key=len)
    eos = D.eos_ids(tok, model)
    longest = max(map(len, prompts)) + args.answer_tokens
    results: dict = {"writers": []}

    def generate(batch):
        outs = []
        for i in range(0, len(batch), args.batch):
            outs += D.sample_segmented(model, tok, batch[i: i + args.batch], max_new=args.answer_tokens,
                                       segment=args.segment, temperature=0.0, top_p=1.0, seed=0)
        return outs

    def continuous(rows: int, graphs: bool = True):
        sampler = ContinuousSampler(model, rows=rows, max_length=longest, eos=eos, graphs=graphs)
        return (f"continuous {rows}" + ("" if graphs else " eager"),
                lambda batch: sampler.run(batch, max_new=args.answer_tokens, temperature=0.0, top_p=1.0, seed=0))

    writers = [] if args.no_generate else [("generate", generate)]
    counts = [int(r) for r in args.rows.split(",") if r.strip()]  # as --rows checked them ("512," is one)
    for rows in counts[:-1]:
        writers.append(continuous(rows))
    if args.eager:
        writers.append(continuous(counts[-1], graphs=False))
    writers.append(continuous(counts[-1]))  # last: the one --profile runs again
    reference = None
    for name, write in writers:
        write(prompts[:16])  # warm-up: kernels, allocator
        sync()
        t0 = time.perf_counter()
        outs = write(prompts)
        sync()
        dt = time.perf_counter() - t0
        tokens = sum(len(ids) for ids, _ in outs)
        reference = reference or outs
        same = sum(a == b for a, b in zip(outs, reference))
        rec = {"writer": name, "seconds": round(dt, 2), "answer_tokens": tokens,
               "ended": sum(e for _, e in outs), "tokens_per_s": round(tokens / dt),
               "same_as_first": same, "answers": len(outs)}  # answers equal to the first writer's (x_first's)
        rec["x_first"] = round(rec["tokens_per_s"] / results["writers"][0]["tokens_per_s"], 2) \
            if results["writers"] else 1.0
        results["writers"].append(rec)
        print(f"{name:16s} {dt:7.1f} s  {tokens:8d} answer tokens  {rec['tokens_per_s']:7d} tok/s  "
              f"{rec['x_first']:5.2f}x {writers[0][0]}  same answers {same}/{len(outs)}", flush=True)
        if args.json is not None:
            write_record(args.json, {k: str(v) for k, v in vars(args).items()}, results)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.profile:
        results["profile"] = profile(writers[-1], prompts, args.device)
        if args.json is not None:
            write_record(args.json, {k: str(v) for k, v in vars(args).items()}, results)
    return 0


def profile(writer, prompts: list[list[int]], device: str, top: int = 20) -> list[dict]:
    """Runs one writer on the prompts under torch's profiler; prints and returns its costliest operations."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    name, write = writer
    on_gpu = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        write(prompts)
        if on_gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    # The operators only: on a GPU each kernel is listed again under its own name, its time already its operator's.
    ops = [e for e in prof.key_averages() if not on_gpu or getattr(e, "device_type", None) != DeviceType.CUDA]
    events = sorted(ops, key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1.0
    rows = [{"op": e.key, "calls": e.count, "ms": round(getattr(e, key) / 1e3, 2),
             "share": round(getattr(e, key) / total, 4)} for e in events[:top]]
    rows.append({"op": "(all operators)", "calls": sum(e.count for e in events), "ms": round(total / 1e3, 2),
                 "share": 1.0, "busy": round(total / 1e6 / wall, 3)})
    print(f"{name}: {wall:.1f} s under the profiler, {'device' if on_gpu else 'CPU'} busy {total / 1e6:.1f} s "
          f"({total / 1e6 / wall:.0%}); by operation:")
    for r in rows[:-1]:
        print(f"  {r['share']:6.1%} {r['ms']:10.1f} ms {r['calls']:8d} calls  {r['op'][:70]}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
