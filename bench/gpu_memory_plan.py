"""One H200, issue 12: 8-bit and 4-bit targets, and the memory plan against measured peaks.

Part A, the default pair (bf16 folders): the target in bf16 (the reference), int8 and nf4, each
with the draft in bf16 and in int8. Per run: the plan (made before loading) vs the measured
process peak (torch's peak allocation + what lives outside its allocator: CUDA context, library
kernels, graph executables), standard and speculative tok/s (greedy, K=5), and greedy outputs
against the bf16 target's, counted, with first divergences.
Part B, random-weight targets of Qwen2.5-14B/32B-Instruct's shapes (built on the GPU, no download)
in bf16 and nf4 with the real 0.5B draft: plan vs measured peak, standard and speculative tok/s
(a random target agrees with no draft: speculative shows the cost of drafting, not its gain).
Last, in a subprocess, whether bitsandbytes' int8 and nf4 layers can be captured in a CUDA graph.

    python3 bench/gpu_memory_plan.py --target path/to/Qwen2.5-Coder-1.5B-Instruct --draft path/to/Qwen2.5-Coder-0.5B-Instruct --json gpu_memory_plan.json   # ~4-5 min, one H200
    python3 bench/gpu_memory_plan.py --tiny                                             # CPU dry run, tiny shapes

Writes a bench record (bench/record.py) to --json after every run.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_probes as qc  # noqa: E402
import torch  # noqa: E402

TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 400, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def measure(device: str) -> list[dict]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return [qc.cuda_measure(torch.device(device).index or 0)]
    return []


def part_a(args, results: qc.Results, texts: list[str], reference: dict) -> None:
    from engine.assemble import engine_for_pair
    from engine.decoding import Engine
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    runs = [("bfloat16", "bfloat16"), ("int8", "bfloat16"), ("nf4", "bfloat16"), ("int8", "int8"), ("nf4", "int8")]
    for target_p, draft_p in runs:
        if args.no_bnb and (target_p, draft_p) != ("bfloat16", "bfloat16"):
            continue

        def run(target_p=target_p, draft_p=draft_p) -> dict:
            cpu = qc.CpuPeak() if args.device == "cpu" else None
            if cpu:
                cpu.__enter__()
            pair = load_pair(LoadSpec(args.target, args.draft, device=args.device, target_precision=target_p,
                                      draft_precision=draft_p, context=args.context, force=True))
            measure_costs = Engine.measure_costs
            Engine.measure_costs = lambda self, *a, **k: None  # seconds per int8 run; part B measures them
            try:
                engine = engine_for_pair(pair, LoadSpec(head=None))
            finally:
                Engine.measure_costs = measure_costs
            out = qc.run_prompts(engine, texts, args.max_new_tokens)
            measured = measure(args.device)
            if cpu:
                cpu.__exit__()
                measured = [{"peak_allocated": cpu.peak, "process_peak": cpu.peak}]
            rows = qc.compare_plan(pair.plan, measured)
            if target_p == "bfloat16" and draft_p == "bfloat16":
                reference["ids"] = out["standard"]["token_ids"]
            vs_bf16 = {m: qc.compare_ids(reference.get("ids", []), out[m]["token_ids"])
                       for m in ("standard", "speculative")} if reference.get("ids") else None
            print(f"    {engine.info.fast_path} ({engine.info.fast_path_note or 'graphs for both'})\n"
                  f"    {qc.plan_line(rows)}\n    {qc.speeds(out)}; speculative == standard: "
                  f"{out['spec_identical_to_standard']['identical']}/{len(texts)}"
                  + (f"; vs bf16 target: standard {vs_bf16['standard']['identical']}/{len(texts)}, speculative "
                     f"{vs_bf16['speculative']['identical']}/{len(texts)}, first divergences "
                     f"{[d['position'] for d in vs_bf16['standard']['divergences']]}" if vs_bf16 else ""), flush=True)
            return {"part": "A", "target": target_p, "draft": draft_p, "fast_path": engine.info.fast_path,
                    "fast_path_note": engine.info.fast_path_note, "plan_vs_measured": rows, "decoding": out,
                    "vs_bf16_target": vs_bf16, "runner": pair.plan.runner}

        qc.guarded(results, f"A default pair: target {target_p}, draft {draft_p}", run, args.budget_s)


def part_b(args, results: qc.Results, texts: list[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.assemble import engine_for_pair
    from engine.loadspec import LoadSpec
    from engine.models.census import census_from_config, census_from_folder
    from engine.models.loader import LoadedPair
    from engine.models.planner import ModelFigures, plan_models
    from engine.models.presets import preset_model
    from engine.types import ModelInfo

    shapes = [("14B", "Qwen/Qwen2.5-14B-Instruct"), ("32B", "Qwen/Qwen2.5-32B-Instruct")]
    for shape, model_id in shapes:
        config = TINY if args.tiny else dict(preset_model(model_id).config)
        for precision in ("bfloat16", "nf4"):
            if args.no_bnb and precision == "nf4":
                continue

            def run(shape=shape, config=config, precision=precision) -> dict:
                census = census_from_config(config, f"random {shape}")
                draft_census = census_from_folder(Path(args.draft), "draft")
                plan = plan_models(ModelFigures(census, None, None), ModelFigures(draft_census, args.draft, None),
                                   device=args.device, target_precision=precision, context=args.random_context)
                target = qc.random_qwen2(config, precision, args.device, seed=1)
                draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.bfloat16,
                                                             device_map={"": args.device}).eval()
                tokenizer = AutoTokenizer.from_pretrained(args.draft)
                vocab = min(target.get_output_embeddings().out_features, draft.get_output_embeddings().out_features)
                info = ModelInfo(target_name=f"random {shape}", draft_name="draft", device=args.device,
                                 dtype="bfloat16", fast_path="eager", vocab_size=vocab, target_precision=precision,
                                 draft_precision="bfloat16")
                pair = LoadedPair(target, draft, tokenizer, info, vocab, plan)
                qc.reset_peaks()  # building random weights is not loading: the peak starts here
                engine = engine_for_pair(pair, LoadSpec(head=None))
                out = qc.run_prompts(engine, texts[:2], args.max_new_tokens)
                rows = qc.compare_plan(plan, measure(args.device)) if args.device != "cpu" else []
                print(f"    {engine.info.fast_path} ({engine.info.fast_path_note or 'graphs for both'})\n"
                      f"    {qc.plan_line(rows)}\n    {qc.speeds(out)}", flush=True)
                costs = {"draft_ms": engine.info.draft_ms, "target_ms": dict(engine.info.target_ms)}
                return {"part": "B", "shape": shape, "target": precision, "fast_path": engine.info.fast_path,
                        "fast_path_note": engine.info.fast_path_note, "plan_vs_measured": rows, "decoding": out,
                        "forward_ms": costs}

            qc.guarded(results, f"B random {shape}-shaped target {precision} + 0.5B draft", run, args.budget_s)


PROBE = r"""
import sys, torch, bitsandbytes as bnb
kind = sys.argv[1]
torch.manual_seed(0)
w = torch.randn(8960, 1536, dtype=torch.bfloat16) * 0.02
if kind == "int8":
    layer = bnb.nn.Linear8bitLt(1536, 8960, bias=False, has_fp16_weights=False, threshold=6.0)
    layer.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
else:
    layer = bnb.nn.Linear4bit(1536, 8960, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
layer = layer.cuda()
for width in (1, 6):
    x = torch.randn(width, 1536, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            ref = layer(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = layer(x)
    g.replay()
    torch.cuda.synchronize()
    print(kind, "width", width, "captured; max |graph - eager| =", float((y - ref).abs().max()))
"""


def probe_capture(results: qc.Results, deadline: float) -> None:
    for kind in ("nf4", "int8"):
        def run(kind=kind) -> dict:
            p = subprocess.run([sys.executable, "-c", PROBE, kind], capture_output=True, text=True, timeout=90)
            tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
            print("    " + "\n    ".join(tail), flush=True)
            return {"kind": kind, "captured": p.returncode == 0, "output": tail}

        qc.guarded(results, f"capture probe: one bitsandbytes {kind} layer in a CUDA graph", run, deadline)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="a bf16 model folder (not needed with --tiny)")
    p.add_argument("--draft", default=None, help="a bf16 model folder (not needed with --tiny)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--context", type=int, default=None, help="part A's context (default 8192)")
    p.add_argument("--random-context", type=int, default=4096, help="part B's context (fewer graphs to capture)")
    p.add_argument("--budget-s", type=float, default=270, help="no new run starts after this many seconds")
    p.add_argument("--parts", default="a,b,probe")
    p.add_argument("--json", type=Path, default=Path("gpu_memory_plan.json"), help="the bench record")
    p.add_argument("--tiny", action="store_true", help="CPU dry run: tiny random pair, tiny 'big' targets")
    args = p.parse_args(argv)
    if not args.tiny and not (args.target and args.draft):
        p.error("--target and --draft are needed (or --tiny)")
    from engine.models.quant import bitsandbytes_problem

    args.no_bnb = bitsandbytes_problem() is not None
    results = qc.Results(args.json)
    if args.tiny:
        import tempfile

        from tests.tiny import save_pair

        args.device = "cpu"
        args.target, args.draft = (str(x) for x in save_pair(Path(tempfile.mkdtemp()), noise=0.02, seed=0))
        args.random_context = 256
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "args": vars(args)}
    if torch.cuda.is_available() and args.device != "cpu":
        torch.zeros(1, device="cuda") @ torch.zeros(1, 1, device="cuda")  # context + cuBLAS up front
        env["gpu"] = torch.cuda.get_device_name()
        env["outside_allocator_at_start_gib"] = qc.cuda_measure(0)["outside_allocator"] / qc.GiB
    try:
        import transformers

        from engine.models.quant import import_bitsandbytes

        bitsandbytes = import_bitsandbytes()

        env.update(transformers=transformers.__version__, bitsandbytes=bitsandbytes.__version__)
    except ImportError:
        env["bitsandbytes"] = None
    results.data["environment"] = env
    print(json.dumps({k: v for k, v in env.items() if k != "args"}), flush=True)
    texts = qc.prompts(args.prompts)
    parts = set(args.parts.split(","))
    reference: dict = {}
    if "a" in parts:
        part_a(args, results, texts, reference)
    if "b" in parts:
        part_b(args, results, texts)
    if "probe" in parts and torch.cuda.is_available() and args.device != "cpu" and not args.no_bnb:
        probe_capture(results, args.budget_s + 20)
    results.save()
    print(f"[{qc.elapsed():5.0f}s] done: {results.path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
