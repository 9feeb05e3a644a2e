"""A tiny target with a draft head trained on it (seconds on a CPU), and engines that use it."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.decoding import Engine
from engine.heads.distill import Distiller, DistillPlan
from engine.heads.shards import load_head, read_manifest
from engine.heads.train import TrainConfig
from engine.types import ModelInfo
from tests.tiny import save_predictable_target

TINY_PLAN = DistillPlan(
    minutes=60, question_batch=32, question_tokens=24, answer_tokens=48, intermediate=64, draft_vocab=256,
    eval_sequences=8, eval_every_s=1e9, checkpoint_every_s=1e9, log_every=10, max_rounds=4, max_steps=150,
    questions_must_end=False,  # a random model never ends its question
    train=TrainConfig(depth=4, batch_tokens=1024, max_len=96, lr=3e-3),
)


@dataclass(frozen=True)
class TinyHead:
    target: Path  # the predictable tiny target's folder
    head: Path  # the trained head's folder (shards + manifest + log)
    work: Path  # the distillation's work folder
    summary: dict  # what Distiller.run returned


def load_target(folder: Path, dtype: torch.dtype = torch.float32):
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval().requires_grad_(False)
    return model, tok


def distiller(target: Path, out: Path, work: Path, plan: DistillPlan = TINY_PLAN, **kw) -> Distiller:
    model, tok = load_target(target)
    return Distiller(model, tok, work=work, out=out, plan=plan, name="tiny head", **kw)


def build_tiny_head(root: Path) -> TinyHead:
    target = save_predictable_target(root / "target")
    torch.manual_seed(0)
    summary = distiller(target, root / "head", root / "work").run()
    return TinyHead(target, root / "head", root / "work", summary)


def two_layer_head(tiny: TinyHead, folder: Path) -> Path:
    """`tiny`'s head with a second decoder layer whose output projections are random (not the identity a grown
    layer starts as), saved as a head folder."""
    from engine.heads.config import fingerprint
    from engine.heads.shards import save_head

    files = read_manifest(tiny.head)
    head = load_head(files, torch.device("cpu"), torch.float32).grown(2)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for w in (head.more[0].wo, head.more[0].w2):
            w.copy_(torch.randn(w.shape, generator=gen) * 0.05)
    target, _ = load_target(tiny.target)
    save_head(head, folder, name="tiny two-layer head", target=fingerprint(target), training=files.manifest["training"])
    return folder


def head_engine(target: Path, head: Path, dtype: torch.dtype = torch.float32, *, static: bool = False,
                quant: str | None = None) -> Engine:
    """An engine on the tiny target (eager runner, no draft model) with the head attached.

    static: the fast path's static-cache runner instead (run eagerly on the CPU), which does tree forwards.
    quant: the head's layer in this 8-bit precision ("int8-wo")."""
    model, tok = load_target(target, dtype)
    info = ModelInfo(target_name="tiny-target", draft_name=None, device="cpu",
                     dtype=str(dtype).removeprefix("torch."), fast_path="static-eager" if static else "eager",
                     vocab_size=len(tok))
    runner = None
    if static:
        from engine.runners.graphs import StaticGraphRunner

        runner = StaticGraphRunner(model, max_length=512, graph_widths=(1,))
    engine = Engine(model, tok, info, target_runner=runner)
    files = read_manifest(head)
    drafter = load_head(files, torch.device("cpu"), dtype).bind(model)
    if quant is not None:
        drafter.quantize(quant)
    engine.attach_head(drafter, files.name)
    return engine


def cuda_head_engine(target: Path, head: Path) -> Engine:
    """The tiny target on CUDA graph runners (float32, widths 1..13) with the head attached (GPU tests)."""
    from engine.runners.graphs import StaticGraphRunner

    model, tok = load_target(target)
    model = model.to("cuda")
    runner = StaticGraphRunner(model, max_length=512, graph_widths=range(1, 14))
    runner.warmup()
    info = ModelInfo(target_name="tiny-target", draft_name=None, device="cuda", dtype="float32",
                     fast_path=runner.name, vocab_size=len(tok))
    engine = Engine(model, tok, info, target_runner=runner)
    files = read_manifest(head)
    engine.attach_head(load_head(files, torch.device("cuda"), torch.float32).bind(model), files.name)
    return engine


def quick_plan(**changes) -> DistillPlan:
    return replace(TINY_PLAN, **changes)
