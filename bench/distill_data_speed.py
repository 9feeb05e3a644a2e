"""How fast the distillation writes its data: batched generate on the target, per batch size and segmenting.

The shipped head's training spent 5.3 of its 12.5 H200 minutes writing 790k answer tokens
(about 2.5k tokens/s) and then overfitted them (training agreement 0.85, held-out 0.55): data is
what limits it. This measures, on the real target, the levers `distill --plan` can set:

    python bench/distill_data_speed.py --target path/to/Qwen2.5-Coder-1.5B-Instruct --json distill_data_speed.json

1. decode steps of one batched generate at 512, 1024 and 2048 rows (greedy, fixed length): if the
   step time grows with the rows the GPU is the limit, if not the host is (then bigger batches pay);
2. where the GPU time goes at 1024 rows (torch.profiler, top kernels);
3. answers of up to 320 tokens (as distill writes them) to 1024 questions in one generate vs in
   segments (rows that ended drop out between segments): seconds and answer tokens per second.
Prints a table; writes a bench record to --json. --recommend FILE writes the `distill --plan` options
these figures favour: 2048 questions a round when 2048 rows decode at under 1.6x the step time of
1024 (the host, not the GPU, is then the limit), answers in segments when that is 5% faster.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_record  # noqa: E402

TOPICS = ["binary search trees", "the French revolution", "photosynthesis", "Python decorators", "compound interest",
          "TCP congestion control", "how vaccines work", "writing a cover letter", "SQL joins", "black holes",
          "快速排序的原理", "如何学习英语口语", "the Pythagorean theorem", "Rust ownership", "a healthy breakfast",
          "gradient descent", "the water cycle", "JavaScript promises", "唐诗的特点", "Kubernetes pods"]
FORMS = ["Explain {} to a beginner.", "Write a short guide about {}.", "What are common mistakes with {}?",
         "Give an example involving {} and walk through it.", "Summarise {} in a few paragraphs."]


def questions(n: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(TOPICS[(i // len(FORMS)) % len(TOPICS)]) + f" (#{i})" for i in range(n)]


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.heads import data as D

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--json", type=Path, default=None, help="write the figures as a bench record")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="512,1024,2048")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--answer-rows", type=int, default=1024)
    ap.add_argument("--answer-tokens", type=int, default=320)
    ap.add_argument("--segments", default="0,128")
    ap.add_argument("--recommend", type=Path, default=None, help="write the favoured --plan options here")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    try:
        tok = AutoTokenizer.from_pretrained(args.target)
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
    except (OSError, ValueError, RuntimeError) as e:  # no such folder, not a model, a device torch cannot use
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"distill_data_speed: cannot load {args.target} on {args.device}: {first}", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    results: dict = {"steps": [], "answers": []}

    def save() -> None:
        if args.json is not None:
            write_record(args.json, {k: str(v) for k, v in vars(args).items()}, results)

    qs = questions(max(int(r) for r in args.rows.split(",")))
    prompts_all = [D.answer_prompt(tok, q, None) for q in qs]
    D.sample_batch(model, tok, prompts_all[:64], max_new=4, temperature=0.0, top_p=1.0, seed=0)  # warm-up
    for rows in (int(r) for r in args.rows.split(",")):
        prompts = prompts_all[:rows]
        try:
            sync()
            t0 = time.perf_counter()
            # min_new_tokens would need another config; a fixed-length decode: EOS is rare within 48 tokens.
            outs = D.sample_batch(model, tok, prompts, max_new=args.steps, temperature=0.0, top_p=1.0, seed=0)
            sync()
            dt = time.perf_counter() - t0
        except torch.OutOfMemoryError:
            print(f"rows {rows}: out of memory", flush=True)
            torch.cuda.empty_cache()
            continue
        toks = sum(len(ids) for ids, _ in outs)
        rec = {"rows": rows, "seconds": round(dt, 3), "ms_per_step": round(1000 * dt / args.steps, 2),
               "tokens_per_s": round(toks / dt), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
               if args.device.startswith("cuda") else None}
        results["steps"].append(rec)
        print(f"rows {rows:5d}: {rec['ms_per_step']:7.2f} ms/step, {rec['tokens_per_s']:7d} tok/s, "
              f"peak {rec['peak_gib']} GiB", flush=True)
        save()

    if args.device.startswith("cuda"):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            D.sample_batch(model, tok, prompts_all[:1024], max_new=8, temperature=0.0, top_p=1.0, seed=0)
            sync()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
        print(table, flush=True)
        results["profile"] = table

    for segment in (int(s) for s in args.segments.split(",")):
        prompts = prompts_all[: args.answer_rows]
        sync()
        t0 = time.perf_counter()
        outs = D.sample_segmented(model, tok, prompts, max_new=args.answer_tokens, segment=segment,
                                  temperature=0.0, top_p=1.0, seed=0)
        sync()
        dt = time.perf_counter() - t0
        toks = sum(len(ids) for ids, _ in outs)
        ended = sum(e for _, e in outs)
        rec = {"segment": segment, "rows": len(prompts), "seconds": round(dt, 2), "answer_tokens": toks,
               "ended": ended, "tokens_per_s": round(toks / dt)}
        results["answers"].append(rec)
        print(f"answers, segment {segment:4d}: {dt:6.1f} s, {toks} tokens ({ended} ended), "
              f"{rec['tokens_per_s']} tok/s", flush=True)
        save()
    if args.recommend is not None:
        step = {r["rows"]: r["ms_per_step"] for r in results["steps"]}
        batch = 2048 if 2048 in step and 1024 in step and step[2048] < 1.6 * step[1024] else 1024
        rate = {r["segment"]: r["tokens_per_s"] for r in results["answers"]}
        best = max(rate, key=rate.get) if rate else 0
        segment = best if best and rate[best] > 1.05 * rate.get(0, 0) else 0
        options = f"--plan question_batch={batch} --plan answer_segment={segment}"
        args.recommend.write_text(options + "\n")
        results["recommended"] = options
        print("recommended:", options, flush=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
