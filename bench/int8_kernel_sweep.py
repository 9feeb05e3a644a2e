"""Which tile streams 8-bit weights fastest at decoding's few rows? Tunes the production kernel on one GPU.

For every linear shape of the targets and drafts this project meets (Qwen2.5 0.5B, 1.5B, 14B, 32B:
fused q/k/v, o, fused gate/up, down) and the row counts of decoding (1: a standard step; 6: a K = 5
verify; 16: a tree), times engine/models/fastquant_kernel.matmul over tile shapes (columns per
program, depth per step, pipelining stages, split-K) beside bf16 `F.linear` (cuBLAS) on the same
shape. Each timing replays one CUDA graph of C back-to-back matmuls on C different weight copies
(together larger than the L2 cache, as a forward's layers are) and divides by C, so launch gaps and
cache misses count as in a real forward. The fastest tile per (shape, row band) is written to the
kernel's tuned table under this GPU's name (`--tuned`); the JSON keeps every timing.

    python3 bench/int8_kernel_sweep.py --json out.json --tuned     # one H200, ~5 min
    python3 bench/int8_kernel_sweep.py --widens --rows 1,6 --tuned # fp8: which way to widen e4m3, ~1 min
    TRITON_INTERPRET=1 python3 bench/int8_kernel_sweep.py --check  # the kernel's maths on a CPU
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.models import fastquant as fq
from engine.models import fastquant_kernel as kernel
from engine.models.fastquant_kernel import Tile
from engine.runners import rope_kernel

SHAPES = {  # name -> (N out, K in)
    "14B qkv": (7168, 5120), "14B o": (5120, 5120), "14B gate_up": (27648, 5120), "14B down": (5120, 13824),
    "32B qkv": (7168, 5120), "32B gate_up": (55296, 5120), "32B down": (5120, 27648),
    "1.5B qkv": (2048, 1536), "1.5B o": (1536, 1536), "1.5B gate_up": (17920, 1536), "1.5B down": (1536, 8960),
    "0.5B qkv": (1152, 896), "0.5B o": (896, 896), "0.5B gate_up": (9728, 896), "0.5B down": (896, 4864),
}
L2_BYTES = 60 << 20  # H200: 50 MB of L2; the copies together are several times that


def tiles(n: int, k: int) -> list[Tile]:
    """The candidates for one shape: each is one compile (~0.5 s), so the grid stays small."""
    out = []
    for bn, bk, stages in itertools.product((16, 32, 64, 128), (128, 256), (3, 4)):
        blocks = -(-n // bn)
        for split in (1, 2, 4, 8):
            if split > 1 and (k // split < 2 * bk or blocks * split > 4096):
                continue
            if blocks * split < 64:
                continue  # too few programs to stream from every SM
            out.append(Tile(bn, bk, split, 4, stages))
    return out


def time_graph(fn, reps: int = 10) -> float:
    """Microseconds of one fn() call, from a CUDA graph replayed reps times (fn runs C matmuls; divide outside)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / reps


def check() -> int:
    """The production kernels (every path of the matmul: split-K, bias, residual, ragged K; the norm and
    silu * up kernels) against float32 references.

    TRITON_INTERPRET=1 runs them on a CPU, where numpy has no bf16 matmul: fp16 there, bf16 on a GPU.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    bad = 0

    def verdict(label: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        nonlocal bad
        err = (got.float() - ref).abs().max().item() / ref.abs().max().item()
        ok = err < 2e-2
        bad += not ok
        print(f"{label}: rel err {err:.2e} {'ok' if ok else 'BAD'}")

    # fp8 in each way of widening its tiles (the PTX way only on a GPU: the interpreter has no PTX)
    ways = [("int8-wo", "bits")] + [("fp8", w) for w in kernel.WIDENS if w != "asm" or device == "cuda"]
    cases = itertools.product([(96, 320), (64, 256)], (1, 3, 16, 40), ways, (1, 2), (False, True))
    for (n, k), m, (kind, way), split, extras in cases:
        w = torch.randn(n, k, device=device) * 0.05
        q, s = fq.quantize(w, kind)
        x = torch.randn(m, k, device=device).to(dtype)
        bias = torch.randn(n, device=device).to(dtype) if extras else None
        res = torch.randn(m, n, device=device).to(dtype) if extras else None
        ref = x.float() @ fq.dequantize(q, s).T
        if extras:
            ref = ref + bias.float() + res.float()
        got = kernel.matmul(x, q, s, bias, res, tile=Tile(32, 64, split, 4, 2), widen=way)
        label = kind if kind == "int8-wo" else f"fp8/{way}"
        verdict(f"{label:12s} m={m:2d} n={n} k={k} split={split} bias+res={extras!s:5s}", got, ref)
    for m, k in itertools.product((1, 3, 16), (320, 896)):
        x = (torch.randn(m, k, device=device) * 20).to(dtype)
        g = (torch.rand(k, device=device) + 0.5).to(dtype)
        ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * g.float()
        verdict(f"rms_norm m={m:2d} k={k}", kernel.rms_norm(x, g, 1e-6), ref)
        gate_up = torch.randn(m, 2 * k, device=device).to(dtype)
        ref = torch.nn.functional.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()
        verdict(f"silu_mul m={m:2d} k={k}", kernel.silu_mul(gate_up), ref)
    print("all ok" if not bad else f"{bad} BAD")
    return 1 if bad else 0


def sweep(args) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    record = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": [], "best": {}}
    t_end = time.time() + args.budget_s
    names = [s for s in SHAPES if not args.shapes or any(s.startswith(p) for p in args.shapes.split(","))]
    seen: set[tuple[int, int, int]] = set()
    for m, name in itertools.product(args.rows, names):  # every shape at one row count first
        n, k = SHAPES[name]
        if (n, k, m) in seen:
            continue
        seen.add((n, k, m))
        if time.time() > t_end:
            print("budget spent", flush=True)
            break
        copies = max(2, min(16, L2_BYTES * 4 // (n * k)))
        w = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        base = time_graph(lambda x=x, w=w: [F.linear(x, wi) for wi in w]) / copies
        key = f"{name} m={m}"
        record["best"][key] = {"bf16_us": round(base, 2), "heuristic": kernel.heuristic(n, k).key()}
        print(f"{key}: bf16 {base:.1f} us ({n * k * 2 / base / 1e3:.0f} GB/s)", flush=True)
        tried: list[dict] = []
        for prec in args.precisions:
            qs = [fq.quantize(wi, prec) for wi in w]
            # fp8 tries the 6 fastest int8 tiles and the heuristic's (the same bytes; the widening differs)
            todo = tiles(n, k) if not tried else \
                [Tile(*r["tile"]) for r in sorted(tried, key=lambda r: r["us"])[:6]] + [kernel.heuristic(n, k)]
            best = None
            for tile in dict.fromkeys(todo):
                try:
                    us = time_graph(lambda t=tile, x=x, qs=qs: [kernel.matmul(x, q, s, tile=t) for q, s in qs]) / copies
                except Exception as e:  # noqa: BLE001 - a tile Triton cannot build here: recorded, not fatal
                    record["rows"].append({"shape": key, "prec": prec, "tile": tile.key(),
                                           "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    continue
                row = {"shape": key, "n": n, "k": k, "m": m, "prec": prec, "tile": tile.key(), "us": round(us, 2),
                       "gbs": round(n * k / us / 1e3, 1), "x_bf16": round(base / us, 3)}
                record["rows"].append(row)
                if prec == args.precisions[0]:
                    tried.append(row)
                if best is None or us < best["us"]:
                    best = row
            if best is not None:
                record["best"][key][prec] = best
                print(f"   {prec}: best {best['tile']} {best['us']:.1f} us ({best['gbs']:.0f} GB/s, "
                      f"{best['x_bf16']:.2f}x bf16)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(record))
    return record


def _prologue_variants(n: int, k: int, down: bool, m: int) -> tuple[dict, int]:
    """The ways to run one layer's pre-matmul step and its matmul, as fns over `copies` weight copies."""
    dev = torch.device("cuda")
    eps = 1e-6
    copies = max(2, min(16, L2_BYTES * 4 // (n * k)))
    w = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    qs = [fq.quantize(wi, "int8-wo") for wi in w]
    g = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
    if down:
        x = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16)
        before = {"torch ops": lambda: F.silu(x[:, :k]) * x[:, k:], "one kernel": lambda: kernel.silu_mul(x)}
    else:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 30
        before = {"torch ops": lambda: g * F.rms_norm(x.float(), (k,), eps=eps).to(x.dtype),
                  "one kernel": lambda: kernel.rms_norm(x, g, eps)}
    h = before["torch ops"]()
    variants = {"bf16 matmul alone": lambda: [F.linear(h, wi) for wi in w],
                "8-bit matmul alone": lambda: [kernel.matmul(h, q, s) for q, s in qs]}
    for label, fn in before.items():
        variants[f"bf16: {label} + matmul"] = lambda fn=fn: [F.linear(fn(), wi) for wi in w]
        variants[f"8-bit: {label} + matmul"] = lambda fn=fn: [kernel.matmul(fn(), q, s) for q, s in qs]
    return variants, copies


def prologues(names: list[str], rows: list[int], out: dict) -> None:
    """What the layer does before a matmul, each way: the RMSNorm before q/k/v and gate/up, silu(gate) * up
    before down — as torch's ops or as one small kernel — then the matmul, beside the matmul alone.

    Microseconds per layer's worth (norm or product, then the matmul), in CUDA graphs over weight copies.
    """
    for name, m in itertools.product(names, rows):
        n, k = SHAPES[name]
        variants, copies = _prologue_variants(n, k, name.endswith("down"), m)
        key = f"{name} m={m}"
        out[key] = {}
        for label, fn in variants.items():
            us = time_graph(fn) / copies
            out[key][label] = round(us, 2)
            print(f"{key:18s} {label:28s} {us:7.1f} us", flush=True)
        del variants
        torch.cuda.empty_cache()


def widens(names: list[str], rows: list[int], out: dict) -> str:
    """Each way of widening e4m3 tiles (kernel.WIDENS), timed with the tuned tile of each shape, beside
    int8-wo and bf16; returns the way with the smallest summed time over every shape and row count."""
    dev = torch.device("cuda")
    totals = dict.fromkeys(kernel.WIDENS, 0.0)
    for name, m in itertools.product(names, rows):
        n, k = SHAPES[name]
        copies = max(2, min(16, L2_BYTES * 4 // (n * k)))
        w = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        key = f"{name} m={m}"
        row = {"bf16": time_graph(lambda x=x, w=w: [F.linear(x, wi) for wi in w]) / copies}
        q8 = [fq.quantize(wi, "int8-wo") for wi in w]
        row["int8-wo"] = time_graph(lambda x=x, q8=q8: [kernel.matmul(x, q, s) for q, s in q8]) / copies
        qf = [fq.quantize(wi, "fp8") for wi in w]
        for way in kernel.WIDENS:
            row[f"fp8 {way}"] = time_graph(
                lambda way=way, x=x, qf=qf: [kernel.matmul(x, q, s, widen=way) for q, s in qf]) / copies
            totals[way] += row[f"fp8 {way}"]
        out[key] = {label: round(us, 2) for label, us in row.items()}
        print(f"{key:18s} " + "  ".join(f"{label} {us:6.1f}" for label, us in row.items()) + "  (us)", flush=True)
        del w, q8, qf
        torch.cuda.empty_cache()
    best = min(totals, key=totals.get)
    print("fp8 widening, summed us: " + ", ".join(f"{w} {t:.0f}" for w, t in totals.items()) + f" -> {best}", flush=True)
    return best


def write_widen(gpu: str, way: str) -> None:
    table = json.loads(kernel.TUNED_FILE.read_text()) if kernel.TUNED_FILE.exists() else {}
    table.setdefault(gpu, {"tiles": {}})["fp8_widen"] = way
    kernel.TUNED_FILE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"fp8 widening for {gpu}: {way} -> {kernel.TUNED_FILE}", flush=True)


def write_tuned(record: dict) -> None:
    """The fastest tile per (shape, row band) into the kernel's table for this GPU.

    Both precisions stream the same bytes, so one tile serves both: among the tiles timed in every
    precision, the one with the smallest summed time.
    """
    times: dict[str, dict[tuple, dict[str, float]]] = {}
    for row in record["rows"]:
        if "us" in row:
            key = kernel.tile_key(row["n"], row["k"], row["m"])
            times.setdefault(key, {}).setdefault(tuple(row["tile"]), {})[row["prec"]] = row["us"]
    best = {}
    for key, by_tile in times.items():
        widest = max(len(t) for t in by_tile.values())
        full = {tile: sum(t.values()) for tile, t in by_tile.items() if len(t) == widest}
        best[key] = list(min(full, key=full.get))
    table = json.loads(kernel.TUNED_FILE.read_text()) if kernel.TUNED_FILE.exists() else {}
    entry = table.setdefault(record["gpu"], {"tiles": {}})
    entry["tiles"].update(dict(sorted(best.items())))
    entry["torch"] = record["torch"]
    kernel.TUNED_FILE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{len(best)} tiles for {record['gpu']} -> {kernel.TUNED_FILE}", flush=True)


def profile(shape: str, precisions: list[str], out: dict, float_head: bool = False) -> None:
    """Where one width-1 forward of a random `shape`-shaped target spends its GPU time, by kernel (eager)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_probes as qc

    from engine.models.presets import preset_model
    from engine.runners.graphs import StaticGraphRunner

    config = dict(preset_model(f"Qwen/Qwen2.5-{shape}-Instruct").config)
    dev = torch.device("cuda")
    for precision in precisions:
        model = qc.random_qwen2(config, "bfloat16", "cuda", seed=1)
        if precision != "bfloat16":
            fq.quantize_model(model, precision, head=False if float_head else None)
        # the graphs with the one-launch RoPE + cache write (engine/runners/rope_kernel.py) and with torch's
        # ops, alternated twice; each figure is the lower of its two
        both: dict[str, list[dict]] = {"fused": [], "torch": []}
        for way in ("torch", "fused", "torch", "fused"):
            fused = rope_kernel.runs
            if way == "torch":
                rope_kernel.runs = lambda x: False
            try:
                graphs = StaticGraphRunner(model, max_length=1024, graph_widths=(1, 6))
                graphs.warmup()
                both[way].append(graphs.measure_costs((1, 6), iters=30))
            finally:
                rope_kernel.runs = fused
            del graphs
            qc.free_memory()
        ms, torch_ms = ({w: min(m[w] for m in both[way]) for w in (1, 6)} for way in ("fused", "torch"))
        runner = StaticGraphRunner(model, max_length=1024, graph_widths=(1,), use_graphs=False)
        runner.prefill(torch.randint(0, 1000, (200,), device=dev))
        ids = torch.tensor([5], device=dev)
        for _ in range(3):
            runner.forward(ids)
            runner.rollback(200)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.forward(ids)
                runner.rollback(200)
            torch.cuda.synchronize()
        kernels = []
        for ev in prof.key_averages():
            t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
            if t > 0:
                kernels.append({"name": ev.key[:110], "us_per_forward": round(t / 5, 1), "calls": ev.count // 5})
        kernels.sort(key=lambda r: -r["us_per_forward"])
        total = sum(r["us_per_forward"] for r in kernels)
        out[f"{shape} {precision}"] = {"graph_ms": ms, "graph_ms_torch_rope": torch_ms,
                                       "eager_kernel_us_total": round(total, 1), "kernels": kernels[:40]}
        print(f"profile {shape} {precision}: graphs {ms} ms (RoPE and cache writes as torch's ops: {torch_ms} ms); "
              f"eager kernels {total:.0f} us per forward", flush=True)
        for r in kernels[:14]:
            print(f"   {r['us_per_forward']:8.1f} us  x{r['calls']:<4d} {r['name']}", flush=True)
        del runner, model
        qc.free_memory()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only check the kernel's maths (small shapes)")
    p.add_argument("--json", default="")
    p.add_argument("--tuned", action="store_true", help="write the winners into engine/models/fastquant_tuned.json")
    p.add_argument("--shapes", default="", help="comma-separated name prefixes (e.g. 14B,1.5B); all by default")
    p.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 6, 16])
    p.add_argument("--precisions", type=lambda s: s.split(","), default=["int8-wo", "fp8"])
    p.add_argument("--budget-s", type=float, default=360.0)
    p.add_argument("--profile", default="", help="also profile one forward of a random 14B/32B-shaped target")
    p.add_argument("--float-head", action="store_true", help="--profile: keep the output head in bf16")
    p.add_argument("--widens", action="store_true",
                   help="only compare the ways to widen fp8 tiles (with --tuned: write the fastest)")
    p.add_argument("--prologues", action="store_true",
                   help="only compare the norm and silu*up before a matmul: torch's ops against one kernel")
    args = p.parse_args()
    if (args.check or os.environ.get("TRITON_INTERPRET") == "1") and not kernel.AVAILABLE:
        p.error("--check runs the Triton kernel (on a CPU under TRITON_INTERPRET=1): pip install triton")
    if args.check or os.environ.get("TRITON_INTERPRET") == "1":
        return check()
    if not torch.cuda.is_available():
        p.error("the sweep times CUDA kernels and this machine has no CUDA GPU; --check runs the maths "
                "on a CPU under TRITON_INTERPRET=1")
    if not set(args.precisions) <= set(fq.FAST_PRECISIONS) or not all(1 <= m <= kernel.MAX_ROWS for m in args.rows):
        p.error(f"--precisions takes {', '.join(fq.FAST_PRECISIONS)}; --rows takes 1..{kernel.MAX_ROWS}")
    if args.widens:
        names = [s for s in SHAPES if not args.shapes or any(s.startswith(p) for p in args.shapes.split(","))]
        out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "widens": {}}
        out["best"] = widens(names, args.rows, out["widens"])
        if args.tuned:
            write_widen(out["gpu"], out["best"])
        if args.json:
            Path(args.json).write_text(json.dumps(out))
        return 0
    if args.prologues:
        names = [s for s in SHAPES if not s.endswith(" o") and (
            not args.shapes or any(s.startswith(p) for p in args.shapes.split(",")))]
        out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "prologues": {}}
        prologues(names, args.rows, out["prologues"])
        if args.json:
            Path(args.json).write_text(json.dumps(out))
        return 0
    record = sweep(args) if args.budget_s > 0 else {"best": {}, "rows": []}
    if args.tuned and record["rows"]:
        write_tuned(record)
    if args.profile:
        record["profile"] = {}
        try:
            profile(args.profile, ["bfloat16", "int8-wo"], record["profile"], args.float_head)
        except Exception as e:  # noqa: BLE001 - the sweep's figures still come back
            record["profile"]["error"] = f"{type(e).__name__}: {e}"
            print("profile failed:", e, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
