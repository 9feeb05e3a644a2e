"""Shared by bench/gpu_memory_plan.py and bench/gpu_split_plan.py: memory probes, random-weight models, runs, comparisons.

No PySide6, gguf or platformdirs needed (the GPU machine has none of them).
"""
from __future__ import annotations

import gc
import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from record import write_record  # noqa: E402
from torch import nn  # noqa: E402

GiB = 2**30
PROMPT_IDS = ("p00", "p05", "p10")  # code, Chinese long form, chat
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "assets" / "bench_prompts.jsonl").read_text("utf-8").splitlines()]
    by_id = {r["id"]: r["prompt"] for r in rows}
    return [by_id[i] for i in PROMPT_IDS[:n]]


class Results:
    """A bench record (bench/record.py) rewritten after every run, so a timeout keeps what finished.

    The environment is its config, every measurement one of its runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {"runs": []}

    def save(self) -> None:
        summary = {"runs": len(self.data["runs"]), **self.data.get("summary", {})}  # a bench's own summary kept
        write_record(self.path, self.data.get("environment", {}), summary, self.data["runs"])


def guarded(results: Results, name: str, fn: Callable[[], dict], deadline: float) -> dict | None:
    """Runs one measurement; records its result or its traceback; skips it past the deadline."""
    if elapsed() > deadline:
        print(f"[{elapsed():5.0f}s] {name}: skipped (past the {deadline:.0f} s budget)", flush=True)
        results.data["runs"].append({"name": name, "skipped": "budget"})
        results.save()
        return None
    print(f"[{elapsed():5.0f}s] {name} ...", flush=True)
    try:
        record = {"name": name, **fn()}
    except Exception as exc:  # one failed run must not cost the others
        traceback.print_exc()
        record = {"name": name, "error": f"{type(exc).__name__}: {exc}"[:400]}
    results.data["runs"].append(record)
    results.save()
    free_memory()
    return record


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            with torch.cuda.device(i):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()


def reset_peaks() -> None:
    """Peaks count from here (what is allocated now is the starting level)."""
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
            torch.cuda.reset_peak_memory_stats(i)


# --------------------------------------------------------------------------- memory

class CpuPeak:
    """Peak anonymous RSS of this process, sampled every 20 ms (file-backed pages of mmapped weights excluded)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def anon() -> int:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.anon())
            time.sleep(0.02)

    def __enter__(self) -> CpuPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.anon())


def cuda_measure(device: int) -> dict:
    """This device's peaks since the last reset, and what lives outside torch's allocator now."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_allocated(device)
    outside = total - free - reserved  # CUDA context, library kernels, graph executables (this process alone)
    return {"peak_allocated": peak, "peak_reserved": torch.cuda.max_memory_reserved(device),
            "outside_allocator": outside, "process_peak": peak + outside, "total": total}


def compare_plan(plan, measured: list[dict]) -> list[dict]:
    """Per device: plan vs the measured process peak (allocations + what is outside the allocator)."""
    rows = []
    for dev, m in zip(plan.devices, measured):
        tensors = sum(i.bytes for i in dev.items if i.kind != "runtime")
        rows.append({
            "device": dev.device,
            "plan_gib": dev.total / GiB,
            "plan_tensors_gib": tensors / GiB,
            "measured_gib": m["process_peak"] / GiB,
            "measured_allocated_gib": m["peak_allocated"] / GiB,
            "measured_reserved_gib": m.get("peak_reserved", 0) / GiB,
            "measured_outside_allocator_gib": m.get("outside_allocator", 0) / GiB,
            "error": dev.total / m["process_peak"] - 1 if m["process_peak"] else None,
            "tensors_error": tensors / m["peak_allocated"] - 1 if m["peak_allocated"] else None,
            "items": {i.label: round(i.bytes / GiB, 4) for i in dev.items},
        })
    return rows


def plan_line(rows: list[dict]) -> str:
    return "; ".join(f"{r['device']} plan {r['plan_gib']:.2f} GiB vs measured {r['measured_gib']:.2f} GiB "
                     f"({100 * (r['error'] or 0):+.1f}%, tensors {100 * (r['tensors_error'] or 0):+.1f}%)"
                     for r in rows)


# --------------------------------------------------------------------------- decoding

def run_prompts(engine, texts: list[str], max_new: int, k: int = 5, proposer: str = "draft") -> dict:
    """Standard and speculative greedy decoding of each prompt: token ids, tok/s, acceptance."""
    from engine.types import GenerationRequest, Message

    def one(text: str, mode: str, n: int):
        generation = engine.generate(GenerationRequest(messages=(Message("user", text),), mode=mode, k=k,
                                                       max_new_tokens=n, proposer=proposer))
        for _ in generation:
            pass
        return generation

    for mode in ("standard", "speculative"):  # untimed: allocator growth, first-call kernels
        one(texts[0], mode, 8)
    out: dict = {}
    for mode in ("standard", "speculative"):
        tokens, seconds, prefill, drafted, accepted, ids = 0, 0.0, 0.0, 0, 0, []
        for text in texts:
            g = one(text, mode, max_new)
            s = g.summary
            tokens += s.new_tokens
            seconds += s.seconds
            prefill += s.prefill_s
            drafted += s.drafted
            accepted += s.accepted
            ids.append(list(g.token_ids))
        # tok_s: the answers' wall time from the request on; decode_tok_s: after the prompt is read
        # (as llama.cpp's eval rate), the rate the weights' bytes bound
        out[mode] = {"tok_s": tokens / seconds if seconds else 0.0, "tokens": tokens, "seconds": seconds,
                     "prefill_s": prefill,
                     "decode_tok_s": tokens / (seconds - prefill) if seconds > prefill else 0.0,
                     "acceptance": accepted / drafted if drafted else None, "token_ids": ids}
    out["spec_identical_to_standard"] = compare_ids(out["standard"]["token_ids"], out["speculative"]["token_ids"])
    return out


def compare_ids(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How many outputs are identical, and the first divergent position of each that is not."""
    identical, divergences = 0, []
    for i, (a, b) in enumerate(zip(reference, other)):
        if a == b:
            identical += 1
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        divergences.append({"prompt": i, "position": pos})
    return {"identical": identical, "compared": min(len(reference), len(other)), "divergences": divergences}


def speeds(run: dict) -> str:
    return (f"standard {run['standard']['tok_s']:.1f} tok/s, speculative {run['speculative']['tok_s']:.1f} tok/s "
            f"(acceptance {100 * (run['speculative']['acceptance'] or 0):.0f}%)")


# --------------------------------------------------------------------------- random-weight models

def random_qwen2(config: dict, precision: str, device: str, seed: int = 0) -> nn.Module:
    """A Qwen2ForCausalLM of `config`'s shape with random weights, built on `device` layer by layer.

    No checkpoint: the model is created on the meta device, each part is materialised where it
    lives and filled from a seeded generator on that device (std 0.02, norms 1, biases 0); nf4
    quantizes each layer's linears with bitsandbytes as soon as they exist, so the peak is the
    4-bit model plus one bf16 layer. `device` may be a device_map {module name: device}.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    cfg = Qwen2Config(**fields)
    cfg._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    placement = device if isinstance(device, dict) else {"": device}

    def where(name: str) -> str:
        best = max((k for k in placement if k == "" or name == k or name.startswith(k + ".")), key=len)
        return placement[best]

    parts = [("model.embed_tokens", model.model.embed_tokens), ("model.norm", model.model.norm)]
    if not cfg.tie_word_embeddings:
        parts.append(("lm_head", model.lm_head))
    parts += [(f"model.layers.{i}", layer) for i, layer in enumerate(model.model.layers)]
    for index, (name, module) in enumerate(parts):
        dev = torch.device(where(name))
        module.to_empty(device=dev)
        gen = torch.Generator(device=dev).manual_seed(seed * 100_003 + index)
        with torch.no_grad():
            for pname, p in module.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0) if "norm" in f"{name}.{pname}" else p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        if precision == "nf4" and name.startswith("model.layers."):
            _quantize_nf4(module)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    # The rotary tables are buffers computed at construction: rebuild them where the first layer is.
    first = torch.device(where("model.layers.0"))
    try:
        rotary = type(model.model.rotary_emb)(config=cfg, device=first)  # transformers versions differ here
    except TypeError:
        rotary = type(model.model.rotary_emb)(config=cfg).to(first)
    model.model.rotary_emb = rotary
    model.eval().requires_grad_(False)
    if isinstance(device, dict) and len(set(device.values())) > 1:
        from accelerate import dispatch_model

        model = dispatch_model(model, device_map=device)  # the hooks from_pretrained(device_map=...) adds
        model.hf_device_map = dict(device)
    return model


def _quantize_nf4(layer: nn.Module) -> None:
    from engine.models.quant import import_bitsandbytes

    bnb = import_bitsandbytes()

    for name, linear in list(layer.named_modules()):
        if type(linear) is not nn.Linear:
            continue
        device = linear.weight.device
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4",
                                     compress_statistics=False, module=q).to(device)  # quantizes here
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        setattr(layer.get_submodule(parent_name) if parent_name else layer, child, q)
        del linear
