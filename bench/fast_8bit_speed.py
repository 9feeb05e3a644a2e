"""Does 8-bit decode faster? bf16 vs int8-wo vs fp8 (engine/models/fastquant.py), one H200, one run.

Part "random": random-weight targets of Qwen2.5-14B/32B-Instruct's shapes (built in bf16 on the GPU,
no download; 8-bit quantized from them), standard tok/s side by side, plan vs measured peak.
Part "pair": the real pair, standard and speculative (draft model, and the draft head) tok/s for
bf16 / int8-wo / fp8 targets and drafts; per-forward costs (target, draft, head); greedy outputs
against the bf16 target's (identical count, first divergences); plan vs measured peak. Each row
loads in a fresh process (--same-process: one after another in this one).
--fp8-act compares FP8 activation modes (none = weight-only; tensor / token = dynamic activation
scales on the FP8 tensor cores) on the random targets.

    .venv/bin/python bench/fast_8bit_speed.py --target path/to/target --draft path/to/draft    # ~8 min, one H200
    .venv/bin/python bench/fast_8bit_speed.py --device cpu --tiny                               # smoke run, tiny shapes

Writes --json (default bench/results/h200_fastquant.json) after every row. --float-head keeps the random
targets' output head in bf16 (fastquant.quantize_model quantizes an untied one on a GPU): what the 8-bit
head buys.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_probes as qc  # noqa: E402
import torch  # noqa: E402

from engine.models import fastquant as fq  # noqa: E402

SHAPES = {"14B": "Qwen/Qwen2.5-14B-Instruct", "32B": "Qwen/Qwen2.5-32B-Instruct"}
TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 400, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
HEAD = "assets/heads/qwen2.5-coder-1.5b-instruct"


def measured(device: str) -> list[dict]:
    return [qc.cuda_measure(torch.device(device).index or 0)] if device.startswith("cuda") else []


def refused(precision: str, device: str) -> str | None:
    return fq.precision_problem(precision, torch.device(device))


def costs(engine) -> dict:
    info = engine.info
    return {"target_ms": dict(info.target_ms), "draft_ms": info.draft_ms, "head_ms": info.head_ms}


def part_random(args, results: qc.Results, texts: list[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.assemble import engine_for_pair
    from engine.loadspec import LoadSpec
    from engine.models.census import census_from_config, census_from_folder
    from engine.models.loader import LoadedPair
    from engine.models.planner import ModelFigures, plan_models
    from engine.models.presets import preset_model
    from engine.types import ModelInfo

    rows = [(s, p, a) for s in args.shapes for p in args.precisions
            for a in (args.fp8_act if p == "fp8" else ["none"])]
    for shape, precision, act in rows:
        def run(shape=shape, precision=precision, act=act) -> dict:
            if (why := refused(precision, args.device)) is not None:
                print(f"    refused: {why}", flush=True)
                return {"refused": why}
            fq.FP8_ACTIVATIONS = act
            config = TINY if args.tiny else dict(preset_model(SHAPES[shape]).config)
            census = census_from_config(config, f"random {shape}")
            plan = plan_models(ModelFigures(census, None, None),
                               ModelFigures(census_from_folder(Path(args.draft), "draft"), args.draft, None),
                               device=args.device, target_precision=precision, context=args.random_context)
            target = qc.random_qwen2(config, "bfloat16", args.device, seed=1)
            if precision != "bfloat16":
                fq.quantize_model(target, precision, head=False if args.float_head else None)
            qc.free_memory()
            draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.bfloat16,
                                                         device_map={"": args.device}).eval()
            tokenizer = AutoTokenizer.from_pretrained(args.draft)
            vocab = min(target.get_output_embeddings().out_features, draft.get_output_embeddings().out_features)
            info = ModelInfo(target_name=f"random {shape}", draft_name="draft", device=args.device, dtype="bfloat16",
                             fast_path="eager", vocab_size=vocab, target_precision=precision,
                             draft_precision="bfloat16")
            qc.reset_peaks()  # building random weights is not loading: the peak starts here
            engine = engine_for_pair(LoadedPair(target, draft, tokenizer, info, vocab, plan), LoadSpec(head=None))
            out = qc.run_prompts(engine, texts[:2], args.max_new_tokens)
            plan_rows = qc.compare_plan(plan, measured(args.device))
            std = out["standard"]
            print(f"    {engine.info.fast_path}; {qc.plan_line(plan_rows)}\n    standard "
                  f"{std['tok_s']:.1f} tok/s ({std['decode_tok_s']:.1f} after the prompt, which took "
                  f"{1e3 * std['prefill_s'] / len(texts[:2]):.1f} ms an answer); "
                  f"target forward ms {costs(engine)['target_ms']}", flush=True)
            return {"part": "random", "shape": shape, "target": precision, "fp8_act": act,
                    "fast_path": engine.info.fast_path, "plan_vs_measured": plan_rows,
                    "standard_tok_s": out["standard"]["tok_s"],
                    "standard_decode_tok_s": out["standard"]["decode_tok_s"], "decoding": out, "forward_ms": costs(engine)}

        qc.guarded(results, f"random {shape}-shaped target {precision}"
                   + (f" (fp8 activations: {act})" if precision == "fp8" else ""), run, args.budget_s)


def part_pair_fresh(args, results: qc.Results) -> None:
    """Each pair row in a process of its own, so no row measures memory an earlier one left behind
    (the plan is compared with a fresh process's peak); the bf16 row's outputs reach the others in a file."""
    import subprocess
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="fastquant-pairs-"))
    reference = folder / "bf16_ids.json"
    passed = ["--target", args.target, "--draft", args.draft, "--head", args.head, "--device", args.device,
              "--max-new-tokens", str(args.max_new_tokens), "--prompts", str(args.prompts),
              "--context", str(args.context), "--reference", str(reference)]
    for n, combo in enumerate(args.pairs):
        name = f"real pair: target {combo.replace('+', ', draft ')}"
        if qc.elapsed() > args.budget_s:
            print(f"[{qc.elapsed():5.0f}s] {name}: skipped (past the {args.budget_s:.0f} s budget)", flush=True)
            results.data["runs"].append({"name": name, "skipped": "budget"})
            continue
        out = folder / f"row{n}.json"
        print(f"[{qc.elapsed():5.0f}s] {name}: a fresh process", flush=True)
        done = subprocess.run([sys.executable, __file__, "--parts", "pair", "--pairs", combo, "--row-out", str(out),
                               *passed], timeout=max(60.0, args.budget_s - qc.elapsed() + 120))
        record = json.loads(out.read_text()) if out.exists() else {"name": name, "error": f"exit {done.returncode}"}
        if combo == "bfloat16+bfloat16" and "decoding" in record:
            reference.write_text(json.dumps(record["decoding"]["standard"]["token_ids"]))
        results.data["runs"].append(record)
        results.save()


def part_pair(args, results: qc.Results, texts: list[str]) -> None:
    from engine.assemble import engine_for_pair
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    reference: dict = {}
    if args.reference and Path(args.reference).exists():
        reference["ids"] = json.loads(Path(args.reference).read_text())
    for combo in args.pairs:
        target_p, draft_p = combo.split("+")

        def run(target_p=target_p, draft_p=draft_p) -> dict:
            why = refused(target_p, args.device) or refused(draft_p, args.device)
            if why is not None:
                print(f"    refused: {why}", flush=True)
                return {"refused": why}
            qc.reset_peaks()
            head = args.head if Path(args.head).is_dir() else None
            # the plan is made with the head it will attach
            pair = load_pair(LoadSpec(args.target, args.draft, device=args.device, target_precision=target_p,
                                      draft_precision=draft_p, context=args.context, force=True, head=head))
            # the draft precision quantizes the head's layer too (engine/assemble.py)
            engine = engine_for_pair(pair, LoadSpec(head=head, draft_precision=draft_p))
            out = qc.run_prompts(engine, texts, args.max_new_tokens)
            if head is not None:
                out["head"] = qc.run_prompts(engine, texts, args.max_new_tokens, proposer="head")["speculative"]
            if (target_p, draft_p) == ("bfloat16", "bfloat16"):
                reference["ids"] = out["standard"]["token_ids"]
            vs = qc.compare_ids(reference["ids"], out["standard"]["token_ids"]) if reference.get("ids") else None
            plan_rows = qc.compare_plan(pair.plan, measured(args.device))
            head_speed = f", head {out['head']['tok_s']:.1f} tok/s" if "head" in out else ""
            fidelity = "-" if vs is None else (f"{vs['identical']}/{vs['compared']} identical, first divergences "
                                               f"{[d['position'] for d in vs['divergences']]}")
            print(f"    {engine.info.fast_path}; {qc.plan_line(plan_rows)}\n    {qc.speeds(out)}{head_speed}\n"
                  f"    forward ms {costs(engine)}\n    standard vs the bf16 target: {fidelity}",
                  flush=True)
            return {"part": "pair", "target": target_p, "draft": draft_p, "fast_path": engine.info.fast_path,
                    "fast_path_note": engine.info.fast_path_note, "plan_vs_measured": plan_rows, "decoding": out,
                    "forward_ms": costs(engine), "vs_bf16_target": vs}

        record = qc.guarded(results, f"real pair: target {target_p}, draft {draft_p}", run, args.budget_s)
        if args.row_out:
            Path(args.row_out).write_text(json.dumps(record, default=str))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="/root/hf/target")
    p.add_argument("--draft", default="/root/hf/draft")
    p.add_argument("--head", default=HEAD, help="draft head folder for the pair's head rows (skipped if absent)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--parts", default="random,pair")
    p.add_argument("--shapes", default="14B,32B", help="random target shapes: 14B, 32B")
    p.add_argument("--precisions", default="bfloat16,int8-wo,fp8", help="the random targets' precisions")
    p.add_argument("--fp8-act", default="none", help="FP8 activation modes to compare: none, tensor, token")
    p.add_argument("--pairs", default="bfloat16+bfloat16,int8-wo+bfloat16,fp8+bfloat16,bfloat16+int8-wo,"
                                      "bfloat16+fp8,int8-wo+int8-wo,fp8+fp8",
                   help="target+draft precisions of the real pair's rows")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--context", type=int, default=4096, help="the pair's context")
    p.add_argument("--random-context", type=int, default=2048, help="the random targets' context (fewer graphs)")
    p.add_argument("--budget-s", type=float, default=500, help="no new row starts after this many seconds")
    p.add_argument("--json", default="", help="where the record goes (default: bench/results/h200_fastquant.json)")
    p.add_argument("--float-head", action="store_true",
                   help="keep the random targets' output head in bf16 (what quantizing it buys)")
    p.add_argument("--tiny", action="store_true", help="tiny random pair and tiny 'big' targets (a smoke run)")
    p.add_argument("--same-process", action="store_true",
                   help="run the pair rows one after another in this process (default: a fresh process each)")
    p.add_argument("--row-out", help=argparse.SUPPRESS)  # a fresh row's process: where its record goes
    p.add_argument("--reference", help=argparse.SUPPRESS)  # ... and the bf16 target's outputs it compares with
    args = p.parse_args(argv)
    if args.json and Path(args.json).is_dir():
        p.error(f"--json {args.json} is a folder: name the file the record goes to")  # before minutes of runs
    for name in ("shapes", "precisions", "fp8_act", "pairs"):
        setattr(args, name, [x.strip() for x in getattr(args, name).split(",") if x.strip()])
    assert set(args.fp8_act) <= set(fq.FP8_MODES), f"--fp8-act takes {fq.FP8_MODES}"
    from engine.errors import ModelLoadError
    from engine.loadspec import normalize_precision

    for combo in args.pairs:
        parts = combo.split("+")
        try:
            if len(parts) != 2:
                raise ModelLoadError(f"--pairs takes TARGET+DRAFT precisions (e.g. fp8+bfloat16), not {combo!r}")
            for precision in (*parts, *args.precisions):
                normalize_precision(precision)
        except ModelLoadError as e:
            p.error(str(e))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch sees no CUDA device (the 8-bit precisions run on a GPU)")
    if not args.tiny:  # every row loads the draft, the pair's rows the target too: say so before any row
        needed = [("--draft", args.draft)] + ([("--target", args.target)] if "pair" in args.parts.split(",") else [])
        for flag, folder in needed:
            if not Path(folder, "config.json").is_file():
                p.error(f"{flag} {folder} is not a model folder (config.json and weights); or run --tiny")
    if args.tiny:
        import tempfile

        from tests.tiny import save_pair

        args.target, args.draft = (str(x) for x in save_pair(Path(tempfile.mkdtemp()), noise=0.02, seed=0))
        args.random_context, args.context = 256, 256
        args.head = "none"
    # a fresh row's process keeps its record beside --row-out, not in the parent's file
    results = qc.Results(Path(args.row_out).with_suffix(".partial.json") if args.row_out else
                         Path(args.json) if args.json else Path(__file__).resolve().parent / "results" / "h200_fastquant.json")
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton_kernel": fq.kernel.AVAILABLE,
           "args": vars(args)}
    if torch.cuda.is_available() and args.device != "cpu":
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = torch.cuda.get_device_capability()
    results.data["environment"] = env
    print(json.dumps({k: v for k, v in env.items() if k != "args"}), flush=True)
    texts = qc.prompts(args.prompts)
    parts = set(args.parts.split(","))
    if "random" in parts:
        part_random(args, results, texts)
    if "pair" in parts:
        if args.row_out or args.same_process or args.tiny:
            part_pair(args, results, texts)
        else:
            part_pair_fresh(args, results)
    if args.row_out:
        return 0  # the parent keeps the record
    results.save()
    print(f"[{qc.elapsed():5.0f}s] done: {results.path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
