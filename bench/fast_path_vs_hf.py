"""One-shot GPU check of the fast path: correctness vs HF, per-forward costs, decode throughput.

Run on a CUDA machine (about 3-5 minutes on an H200; each section is independent and a failure
prints its traceback and moves on):

    python bench/fast_path_vs_hf.py --target path/to/Qwen2.5-Coder-1.5B-Instruct \
        --draft path/to/Qwen2.5-Coder-0.5B-Instruct --json fast_path_vs_hf.json

Results go to stdout and, with --json, to a bench record (rewritten after every section).
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from record import write_record  # noqa: E402

PROMPT = (
    "Write a Python function `quicksort(items: list[int]) -> list[int]` with a docstring and type hints, "
    "then three pytest unit tests for it, then explain its time complexity in two sentences."
)
DEVICE = "cuda"  # --device cpu runs the same script on tiny models, to smoke-test it without a GPU
RESULTS: dict = {}
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


JSON_PATH: list[Path] = []  # --json, once parsed


def save() -> None:
    if JSON_PATH:
        write_record(JSON_PATH[0], RESULTS.get("environment", {}),
                     {k: v for k, v in RESULTS.items() if k != "environment"})


def section(name: str, deadline: float | None = None):
    """Decorator: runs the function now, records its result or traceback, never raises."""

    def run(fn):
        print(f"\n=== {name} (t={elapsed():.0f}s) ===", flush=True)
        if deadline is not None and elapsed() > deadline:
            print(f"skipped: past the {deadline:.0f}s deadline")
            RESULTS[name] = {"skipped": "deadline"}
            save()
            return None
        t = time.perf_counter()
        try:
            value = fn()
            RESULTS[name] = value if value is not None else {"ok": True}
        except Exception as exc:
            traceback.print_exc()
            RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            value = None
        print(f"--- {name}: {time.perf_counter() - t:.1f}s", flush=True)
        save()
        return value

    return run


VOCAB_CAP = [30000]  # random ids stay below this (lowered for tiny models)


def rand_ids(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.randint(0, VOCAB_CAP[0], (n,), generator=generator).to(DEVICE)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_ms(fn, iters: int) -> float:
    """Mean ms of fn() over iters, CUDA events around the whole batch."""
    for _ in range(2):
        fn()
    sync()
    if DEVICE != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) * 1000 / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / iters


def eager_costs(model, prompt: torch.Tensor, widths, iters: int) -> dict[int, float]:
    """HF eager forward (DynamicCache) cost per width at the prompt's context length."""
    from engine.runners import EagerRunner

    runner = EagerRunner(model)
    runner.forward(prompt)
    base = runner.length
    costs = {}
    for w in widths:
        ids = rand_ids(w)

        def step():
            runner.forward(ids)
            runner.rollback(base)

        costs[w] = cuda_ms(step, iters)
    return costs


def greedy_plain(runner, prompt: torch.Tensor, n: int, sync_each: bool) -> tuple[list[int], float]:
    """Standard greedy decoding on a runner; returns (new ids, seconds). Prefill not timed."""
    runner.reset()
    runner.forward(prompt[:-1])
    ids = prompt[-1:]  # [1]
    toks = []
    sync()
    t = time.perf_counter()
    for _ in range(n):
        ids = runner.forward(ids)[-1:].argmax(-1)  # [1], stays on the device
        toks.append(ids)
        if sync_each:
            int(ids)  # what a streaming loop pays: one host sync per token
    sync()
    seconds = time.perf_counter() - t
    return torch.cat(toks).tolist(), seconds


def greedy_speculative(tr, dr, prompt: torch.Tensor, n: int, k: int, vocab: int) -> dict:
    """Minimal greedy speculative loop on two runners, one host sync per step (reference numbers)."""
    tr.reset()
    dr.reset()
    tr.forward(prompt[:-1])
    dr.forward(prompt[:-1])
    last = prompt[-1:]  # [1] the target's pending token
    pending = prompt[-1:]  # [P] tokens the draft has not cached yet (1, or 2 after a full accept)
    out, steps, accepted = [], 0, 0
    sync()
    t = time.perf_counter()
    while sum(len(c) for c in out) < n:
        d0, t0 = dr.length, tr.length
        ids, drafts = pending, []
        for _ in range(k):
            x = dr.forward(ids)[-1:, :vocab].argmax(-1)  # [1]
            drafts.append(x)
            ids = x
        draft = torch.cat(drafts)  # [K]
        best = tr.forward(torch.cat([last, draft]))[:, :vocab].argmax(-1)  # [K+1]
        m = int((best[:k] == draft).int().cumprod(0).sum())  # the one host sync
        out.append(torch.cat([draft[:m], best[m : m + 1]]))
        tr.rollback(t0 + 1 + m)
        if m < k:
            dr.rollback(d0 + len(pending) + m)
            pending = best[m : m + 1]
        else:  # the draft never fed its last token: feed it with the bonus next time
            dr.rollback(d0 + len(pending) + k - 1)
            pending = torch.cat([draft[k - 1 :], best[k : k + 1]])
        last = best[m : m + 1]
        steps += 1
        accepted += m
    sync()
    seconds = time.perf_counter() - t
    tokens = torch.cat(out).tolist()[:n]
    return {"tokens": tokens, "seconds": seconds, "steps": steps, "accepted": accepted}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--deadline", type=float, default=280.0,
                    help="seconds; later sections are skipped past it (compile-heavy ones 60-100 s earlier)")
    ap.add_argument("--skip-hf-static", action="store_true", help="skip the torch.compile baseline (slow to compile)")
    ap.add_argument("--skip-compile", action="store_true", help="skip the compiled lean-forward experiment")
    ap.add_argument("--device", default="cuda", help="cpu: smoke-test this script on small models")
    ap.add_argument("--json", type=Path, default=None, help="write the figures as a bench record")
    args = ap.parse_args()
    if args.json is not None:
        JSON_PATH.append(args.json)
    global DEVICE
    DEVICE = args.device
    n_new = args.new_tokens
    S: dict = {}  # state shared between sections

    @section("environment")
    def _():
        import transformers

        info = {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
            "python": sys.version.split()[0],
        }
        print(info)
        return info

    @section("load")
    def _():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t = time.perf_counter()
        S["target"] = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16).to(DEVICE).eval()
        S["draft"] = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.bfloat16).to(DEVICE).eval()
        VOCAB_CAP[0] = min(30000, S["target"].config.vocab_size, S["draft"].config.vocab_size)
        try:
            tok = AutoTokenizer.from_pretrained(args.target)
            chat = [{"role": "user", "content": PROMPT}]
            text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            S["tokenizer"], S["text"] = tok, text
        except Exception:
            traceback.print_exc()
            print("tokenizer unavailable: using random prompt ids")
            ids = rand_ids(80, torch.Generator().manual_seed(0)).tolist()
        S["prompt"] = torch.tensor(ids, device=DEVICE)
        S["vocab"] = min(S["target"].lm_head.weight.shape[0], S["draft"].lm_head.weight.shape[0])
        out = {
            "seconds": time.perf_counter() - t,
            "prompt_tokens": len(ids),
            "target_attn": S["target"].config._attn_implementation,
            "gpu_mem_gb": torch.cuda.memory_allocated() / 2**30 if DEVICE == "cuda" else None,
        }
        print(out)
        return out

    @section("hf eager per-forward ms")
    def _():
        t = eager_costs(S["target"], S["prompt"], (1, 2, 5, 9), 20)
        d = eager_costs(S["draft"], S["prompt"], (1,), 20)
        S["hf_costs"] = {"target": t, "draft": d}
        print(f"target {fmt(t)}\ndraft  {fmt(d)}")
        return S["hf_costs"]

    @section("build + capture runners")
    def _():
        from engine.runners.graphs import StaticGraphRunner

        out = {}
        for role, widths in (("target", range(1, 10)), ("draft", (1, 2))):
            t = time.perf_counter()
            r = StaticGraphRunner(S[role], max_length=args.max_length, graph_widths=widths)
            r.warmup(lambda f, m: None)
            sync()
            S[f"{role}_runner"] = r
            out[role] = {
                "name": r.name,
                "fallback_reason": r.fallback_reason,
                "graphs": len(r.graphs),
                "spans": r.buckets,
                "capture_s": time.perf_counter() - t,
                "kv_cache_mb": r.decoder.cache_bytes() / 2**20,
                "fused_weights_mb_shared": r.decoder.fused_bytes() / 2**20,
            }
            print(role, out[role])
        out["gpu_mem_gb"] = torch.cuda.memory_allocated() / 2**30 if DEVICE == "cuda" else None
        return out

    @section("correctness vs HF eager (bf16)")
    def _():
        out = {}
        g = torch.Generator().manual_seed(1)
        for role in ("target", "draft"):
            model, r = S[role], S[f"{role}_runner"]
            prompt = S["prompt"]
            extra = rand_ids(16, g)
            seq = torch.cat([prompt, extra])
            with torch.no_grad():
                ref = model(seq[None]).logits[0].float()  # [T, V]
            r.reset()
            rows = [r.forward(prompt).clone()]
            i = len(prompt)
            for w in (1, 1, 4, 2, 1, 5):  # graph widths (draft: 4 and 5 run eagerly)
                rows.append(r.forward(seq[i : i + w]).clone())
                i += w
            # Roll back 3 and redo the same tokens: must reproduce the reference rows.
            r.rollback(r.length - 3)
            rows[-1] = torch.cat([rows[-1][:-3], r.forward(seq[i - 3 : i]).clone()])
            got = torch.cat(rows)
            ref = ref[: got.shape[0]]
            diff = (got - ref).abs()
            agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            tail = slice(len(prompt), got.shape[0])
            out[role] = {
                "max_abs_diff": diff.max().item(),
                "max_abs_diff_decode_rows": diff[tail].max().item(),
                "mean_abs_diff": diff.mean().item(),
                "logit_scale": ref.abs().max().item(),
                "argmax_agreement": agree,
                "argmax_agreement_decode_rows": (got[tail].argmax(-1) == ref[tail].argmax(-1)).float().mean().item(),
            }
            print(role, out[role])
        return out

    @section("fast-path per-forward ms")
    def _():
        tr, dr = S["target_runner"], S["draft_runner"]
        out = {}
        tr.reset()
        tr.forward(S["prompt"])
        out["target_graphs"] = tr.measure_costs(range(1, 10), iters=50)
        dr.reset()
        dr.forward(S["prompt"])
        out["draft_graphs"] = dr.measure_costs((1, 2), iters=50)
        S["costs"] = out
        print(f"target graphs {fmt(out['target_graphs'])}\ndraft graphs  {fmt(out['draft_graphs'])}")
        hf = S.get("hf_costs")
        if hf:
            print(f"speedup vs HF eager, target w=1: {hf['target'][1] / out['target_graphs'][1]:.1f}x, "
                  f"draft w=1: {hf['draft'][1] / out['draft_graphs'][1]:.1f}x")
        return out

    @section("fast-path variants: long context span, math attention, no graphs")
    def _():
        from engine.runners.graphs import StaticGraphRunner

        tr = S["target_runner"]
        out = {}
        # A long context: attention reads the 4096 span instead of 512.
        tr.reset()
        tr.forward(rand_ids(3000))
        out["target_graphs_ctx3000"] = tr.measure_costs((1, 5, 9), iters=30)
        tr.reset()
        for attention in ("math",):
            r = StaticGraphRunner(S["target"], max_length=args.max_length, graph_widths=(1, 5, 9), attention=attention)
            r.warmup()
            r.forward(S["prompt"])
            out[f"target_graphs_{attention}"] = r.measure_costs((1, 5, 9), iters=30)
            r.reset()
            r.forward(rand_ids(3000))
            out[f"target_graphs_{attention}_ctx3000"] = r.measure_costs((1, 5, 9), iters=30)
            del r
        r = StaticGraphRunner(S["target"], max_length=args.max_length, graph_widths=(), use_graphs=False)
        r.forward(S["prompt"])
        out["target_lean_eager"] = r.measure_costs((1, 5, 9), iters=20)
        del r
        for key, v in out.items():
            print(f"{key:32s} {fmt(v)}")
        return out

    @section("plain greedy decode throughput")
    def _():
        tr = S["target_runner"]
        out = {}
        toks, s = greedy_plain(tr, S["prompt"], n_new, sync_each=False)
        out["graphs_no_sync_tok_s"] = n_new / s
        toks2, s2 = greedy_plain(tr, S["prompt"], n_new, sync_each=True)
        out["graphs_sync_each_tok_s"] = n_new / s2
        S["plain_tokens"] = toks
        dtoks, ds = greedy_plain(S["draft_runner"], S["prompt"], n_new, sync_each=True)
        out["draft_graphs_sync_each_tok_s"] = n_new / ds
        if "tokenizer" in S:
            print(repr(S["tokenizer"].decode(toks[:120])))
        print(out)
        return out

    @section("greedy speculative (minimal loop, graphs)")
    def _():
        tr, dr = S["target_runner"], S["draft_runner"]
        from engine.measure.costmodel import CostModel, alpha_from_mean_accepted

        plain = S.get("plain_tokens")
        costs = S.get("costs")
        cm = CostModel(draft_ms=costs["draft_graphs"][1], target_ms=costs["target_graphs"]) if costs else None
        out = {}
        for k in (2, 3, 4, 5, 6, 8):
            r = greedy_speculative(tr, dr, S["prompt"], n_new, k, S["vocab"])
            mean_acc = r["accepted"] / r["steps"]
            alpha = alpha_from_mean_accepted(mean_acc, k)
            row = {
                "tok_s": n_new / r["seconds"],
                "tokens_per_step": n_new / r["steps"],
                "alpha": alpha,
                "first_divergence_from_plain": first_divergence(plain, r["tokens"]) if plain else None,
            }
            if cm:
                row["predicted_speedup"] = cm.predicted_speedup(alpha, k)
                row["verdict"] = cm.verdict(alpha)
            out[k] = row
            print(k, {a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items() if a != "verdict"})
        if cm:
            print(out[4]["verdict"])
        return out

    @section("engine loop end-to-end (engine.decoding.Engine on these runners)", deadline=args.deadline)
    def _():
        from engine.decoding import Engine
        from engine.types import GenerationRequest, ModelInfo

        tok = S["tokenizer"]
        info = ModelInfo("target", "draft", "cuda", "bfloat16", S["target_runner"].name, len(tok))
        eng = Engine(S["target"], tok, info, draft=S["draft"],
                     target_runner=S["target_runner"], draft_runner=S["draft_runner"])
        out = {}
        for label, req in (
            ("standard", GenerationRequest(prompt=S["text"], mode="standard", max_new_tokens=n_new)),
            ("speculative_k4", GenerationRequest(prompt=S["text"], mode="speculative", k=4, max_new_tokens=n_new)),
            ("speculative_k6", GenerationRequest(prompt=S["text"], mode="speculative", k=6, max_new_tokens=n_new)),
            ("ngram_k6", GenerationRequest(prompt=S["text"], mode="speculative", k=6, max_new_tokens=n_new,
                                           proposer="ngram")),
            ("draft+ngram_k6", GenerationRequest(prompt=S["text"], mode="speculative", k=6, max_new_tokens=n_new,
                                                 proposer="draft+ngram")),
        ):
            t = time.perf_counter()
            steps = list(eng.generate(req))
            sync()
            s = time.perf_counter() - t
            new = sum(x.new_tokens for x in steps)
            out[label] = {"new_tokens": new, "seconds_incl_prefill": s, "tok_s": new / s, "steps": len(steps),
                          "stop": steps[-1].stop_reason if steps else None}
            print(label, out[label])
        return out

    @section("HF baselines: hf eager and hf-assisted", deadline=args.deadline)
    def _():
        from engine.measure.baselines import run_hf

        out = {}
        for variant in ("hf", "hf-assisted"):
            r = run_hf(S["target"], S.get("tokenizer"), S["prompt"], n_new, variant, draft=S["draft"])
            out[variant] = {"tok_s": r["new_tokens"] / r["seconds"], "seconds": r["seconds"],
                            "first_divergence_from_plain": first_divergence(S.get("plain_tokens"), r["token_ids"])}
            print(variant, out[variant])
        return out

    @section("experimental: torch.compile'd lean forward under CUDA graphs (width 1, span 512)",
             deadline=-1 if args.skip_compile else args.deadline - 100)
    def _():
        from engine.runners.graphs import StaticGraphRunner

        out = {}
        t = time.perf_counter()
        r = StaticGraphRunner(S["target"], max_length=512, graph_widths=(1,), compile_widths=(1,))
        r.warmup()
        out["compile_and_capture_s"] = time.perf_counter() - t
        out["name"] = r.name
        r.forward(S["prompt"])
        out["target_w1_ms"] = r.measure_costs((1,), iters=50)[1]
        toks, sec = greedy_plain(r, S["prompt"], n_new, sync_each=True)
        out["greedy_sync_each_tok_s"] = n_new / sec
        out["first_divergence_from_plain"] = first_divergence(S.get("plain_tokens"), toks)
        print(out)
        del r
        return out

    if not args.skip_hf_static:
        @section("HF baseline: hf-static (static cache + torch.compile reduce-overhead)", deadline=args.deadline - 60)
        def _():
            from engine.measure.baselines import run_hf

            t = time.perf_counter()
            r = run_hf(S["target"], S.get("tokenizer"), S["prompt"], n_new, "hf-static")
            out = {"tok_s": r["new_tokens"] / r["seconds"], "seconds": r["seconds"],
                   "including_compile_s": time.perf_counter() - t,
                   "first_divergence_from_plain": first_divergence(S.get("plain_tokens"), r["token_ids"])}
            print(out)
            return out

    RESULTS["total_seconds"] = elapsed()
    save()
    print(f"\ndone in {elapsed():.0f}s")


def fmt(costs: dict) -> str:
    return "  ".join(f"w{w}={ms:.3f}ms" for w, ms in costs.items())


def first_divergence(a: list[int] | None, b: list[int]) -> int | None:
    """Index of the first differing token; None when equal over the shorter length."""
    if a is None:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


if __name__ == "__main__":
    main()
