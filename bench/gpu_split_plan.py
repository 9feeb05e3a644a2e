"""Two H200s, issue 12: a target split across GPUs with accelerate's device_map, run by the engine.

Part A: the default pair loaded through the app's own loader with `gpus=2` (the target's layers
balanced over both GPUs, the draft beside its output head): plan vs measured per GPU, tok/s, and
greedy outputs against the same pair on one GPU.
Part B: a random-weight target of Qwen2.5-32B-Instruct's shape (bf16, built on the GPUs, no
download) split as the memory plan places it, with the real 0.5B draft: it runs on the fast path
(one CUDA graph per GPU and width), plan vs measured per GPU, standard and speculative tok/s, the
eager path (accelerate's hooks) for comparison, then the same weights moved onto one GPU: greedy
outputs identical or their first divergences (bf16).

    python3 bench/gpu_split_plan.py --target path/to/Qwen2.5-Coder-1.5B-Instruct --draft path/to/Qwen2.5-Coder-0.5B-Instruct --json gpu_split_plan.json   # ~3 min, nvidia-h200-x2
    python3 bench/gpu_split_plan.py --tiny                                             # CPU dry run (one device)

Writes a bench record (bench/record.py) to --json after every run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_probes as qc  # noqa: E402
import torch  # noqa: E402

TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 400, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def measure_all(devices: list[str]) -> list[dict]:
    out = []
    for name in devices:
        if name.startswith("cuda"):
            torch.cuda.synchronize(torch.device(name))
            out.append(qc.cuda_measure(torch.device(name).index))
    return out


def part_a(args, results: qc.Results, texts: list[str]) -> None:
    from engine.assemble import engine_for_pair
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    runs: dict = {}
    for gpus in (args.gpus, 1):
        def run(gpus=gpus) -> dict:
            pair = load_pair(LoadSpec(args.target, args.draft, device=args.device, gpus=gpus, force=True))
            engine = engine_for_pair(pair, LoadSpec(head=None))
            out = qc.run_prompts(engine, texts, args.max_new_tokens)
            devices = [d.device for d in pair.plan.devices]
            rows = qc.compare_plan(pair.plan, measure_all(devices)) if args.device != "cpu" else []
            runs[gpus] = out
            same = (qc.compare_ids(runs[args.gpus]["standard"]["token_ids"], out["standard"]["token_ids"])
                    if gpus == 1 and args.gpus in runs else None)
            print(f"    devices {pair.info.devices or pair.info.device}; {engine.info.fast_path} "
                  f"({engine.info.fast_path_note or 'no fallback'})\n    {qc.plan_line(rows)}\n    {qc.speeds(out)}"
                  + (f"\n    split vs one GPU, standard: {same['identical']}/{same['compared']} identical, "
                     f"first divergences {[d['position'] for d in same['divergences']]}" if same else ""), flush=True)
            return {"part": "A", "gpus": gpus, "devices": list(pair.info.devices), "fast_path": engine.info.fast_path,
                    "fast_path_note": engine.info.fast_path_note, "plan_vs_measured": rows, "decoding": out,
                    "split_vs_one_gpu": same}

        qc.guarded(results, f"A default pair, target on {gpus} GPU(s)", run, args.budget_s)


def part_b(args, results: qc.Results, texts: list[str]) -> None:
    from accelerate.hooks import remove_hook_from_module
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.assemble import engine_for_pair
    from engine.loadspec import LoadSpec
    from engine.models.census import census_from_config, census_from_folder
    from engine.models.loader import LoadedPair
    from engine.models.planner import ModelFigures, device_maps, plan_models
    from engine.models.presets import preset_model
    from engine.types import ModelInfo

    config = TINY if args.tiny else dict(preset_model("Qwen/Qwen2.5-32B-Instruct").config)
    census = census_from_config(config, "random 32B")
    draft_census = census_from_folder(Path(args.draft), "draft")
    state: dict = {}

    def plan_for(gpus: int):
        return plan_models(ModelFigures(census, None, None), ModelFigures(draft_census, args.draft, None),
                           device=args.device, gpus=gpus, context=args.random_context)

    def engine_for(target, plan, fast_path: str = "auto"):
        draft = state.get("draft")
        _, draft_device = device_maps(plan, args.device)
        if draft is None or str(draft.device) != draft_device:
            state.pop("draft", None)
            qc.free_memory()
            draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.bfloat16,
                                                         device_map={"": draft_device}).eval()
            state["draft"] = draft
        tokenizer = AutoTokenizer.from_pretrained(args.draft)
        vocab = min(target.get_output_embeddings().out_features, draft.get_output_embeddings().out_features)
        info = ModelInfo(target_name="random 32B", draft_name="draft", device=draft_device, dtype="bfloat16",
                         fast_path="eager", vocab_size=vocab,
                         devices=tuple(dict.fromkeys(d.device for d in plan.devices)))
        qc.reset_peaks()  # building random weights is not loading: peaks count from here
        return engine_for_pair(LoadedPair(target, draft, tokenizer, info, vocab, plan), LoadSpec(fast_path=fast_path, head=None))

    def split() -> dict:
        plan = plan_for(args.gpus)
        mapping, _ = device_maps(plan, args.device)
        target = qc.random_qwen2(config, "bfloat16", mapping or args.device, seed=3)
        state["target"] = target
        engine = engine_for(target, plan)
        out = qc.run_prompts(engine, texts[:2], args.max_new_tokens)
        rows = qc.compare_plan(plan, measure_all([d.device for d in plan.devices])) if args.device != "cpu" else []
        state["split_ids"] = out["standard"]["token_ids"]
        print(f"    layers per GPU {[plan.target_layers.count(g) for g in range(len(plan.devices))]}; "
              f"{engine.info.fast_path} ({engine.info.fast_path_note or 'no fallback'})\n"
              f"    {qc.plan_line(rows)}\n    {qc.speeds(out)}", flush=True)
        costs = {"draft_ms": engine.info.draft_ms, "target_ms": dict(engine.info.target_ms)}
        del engine
        return {"part": "B", "gpus": len(plan.devices), "fast_path": "see decoding", "plan_vs_measured": rows,
                "decoding": out, "forward_ms": costs, "device_map_layers": list(plan.target_layers)}

    def split_eager() -> dict:
        plan = plan_for(args.gpus)
        engine = engine_for(state["target"], plan, fast_path="eager")
        out = qc.run_prompts(engine, texts[:1], 32)
        same = qc.compare_ids([ids[:32] for ids in state["split_ids"][:1]], out["standard"]["token_ids"])
        print(f"    {engine.info.fast_path}: {qc.speeds(out)}; vs the fast path: {same['identical']}/1 identical "
              f"{[d['position'] for d in same['divergences']]}", flush=True)
        del engine
        return {"part": "B", "fast_path": "eager (accelerate hooks)", "decoding": out, "vs_fast_path": same}

    def one_gpu() -> dict:
        target = state.pop("target")
        remove_hook_from_module(target, recurse=True)
        first = "cuda:0" if args.device != "cpu" else "cpu"
        target.to(first)  # the same weights, all on one GPU
        if hasattr(target, "hf_device_map"):
            del target.hf_device_map
        qc.free_memory()
        plan = plan_for(1)
        engine = engine_for(target, plan)
        out = qc.run_prompts(engine, texts[:2], args.max_new_tokens)
        rows = qc.compare_plan(plan, measure_all([d.device for d in plan.devices])) if args.device != "cpu" else []
        same = qc.compare_ids(state["split_ids"], out["standard"]["token_ids"])
        print(f"    {engine.info.fast_path}\n    {qc.plan_line(rows)}\n    {qc.speeds(out)}\n"
              f"    split vs one GPU, standard: {same['identical']}/{same['compared']} identical, first divergences "
              f"{[d['position'] for d in same['divergences']]}", flush=True)
        return {"part": "B", "gpus": 1, "plan_vs_measured": rows, "decoding": out, "split_vs_one_gpu": same}

    if qc.guarded(results, f"B random 32B-shaped target split over {args.gpus} GPUs", split, args.budget_s):
        qc.guarded(results, "B the same split target, eager (accelerate's hooks)", split_eager, args.budget_s)
        qc.guarded(results, "B the same weights on one GPU", one_gpu, args.budget_s + 60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="a bf16 model folder (not needed with --tiny)")
    p.add_argument("--draft", default=None, help="a bf16 model folder (not needed with --tiny)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--random-context", type=int, default=4096)
    p.add_argument("--budget-s", type=float, default=170, help="no new run starts after this many seconds")
    p.add_argument("--parts", default="a,b")
    p.add_argument("--json", type=Path, default=Path("gpu_split_plan.json"), help="the bench record")
    p.add_argument("--tiny", action="store_true", help="CPU dry run: tiny random pair, one device")
    args = p.parse_args(argv)
    if not args.tiny and not (args.target and args.draft):
        p.error("--target and --draft are needed (or --tiny)")
    results = qc.Results(args.json)
    if args.tiny:
        import tempfile

        from tests.tiny import save_pair

        args.device, args.gpus, args.random_context = "cpu", 1, 256
        args.target, args.draft = (str(x) for x in save_pair(Path(tempfile.mkdtemp()), noise=0.02, seed=0))
    env = {"torch": torch.__version__, "gpus_visible": torch.cuda.device_count(), "args": vars(args)}
    if args.device != "cpu":
        for i in range(torch.cuda.device_count()):
            with torch.cuda.device(i):
                torch.zeros(1, device="cuda") @ torch.zeros(1, 1, device="cuda")  # contexts + cuBLAS up front
        env["gpu"] = torch.cuda.get_device_name()
        # The random target is generated on each GPU from seeded generators: same seed, same numbers?
        a = torch.empty(1000, device="cuda:0").normal_(generator=torch.Generator("cuda:0").manual_seed(5))
        if torch.cuda.device_count() > 1:
            b = torch.empty(1000, device="cuda:1").normal_(generator=torch.Generator("cuda:1").manual_seed(5))
            env["rng_same_on_both_gpus"] = bool(torch.equal(a.cpu(), b.cpu()))
    results.data["environment"] = env
    print(json.dumps({k: v for k, v in env.items() if k != "args"}), flush=True)
    texts = qc.prompts(args.prompts)
    parts = set(args.parts.split(","))
    if "a" in parts:
        part_a(args, results, texts)
    if "b" in parts:
        part_b(args, results, texts)
    results.save()
    print(f"[{qc.elapsed():5.0f}s] done: {results.path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
