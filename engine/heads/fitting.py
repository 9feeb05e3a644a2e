"""The training phase of a distillation: one head over every data round, checkpointed, evaluated, exported.

`Distiller` (engine/heads/distill.py) mixes this in; it provides the plan, the clock, the state
file, the log and the data rounds.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import pickletools
import struct
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.errors import DistillError
from engine.heads import data as D
from engine.heads.config import HeadConfig, feature_layers
from engine.heads.model import DraftHead
from engine.heads.shards import load_head, save_head
from engine.heads.train import (
    Sequence,
    StepStats,
    Teacher,
    batches,
    collate,
    expected_tokens,
    greedy_acceptance,
    head_loss,
    lr_at,
)

log = logging.getLogger(__name__)


POSITIONS = ("epoch", "batch", "step", "tokens", "batch_tokens")  # what a checkpoint's "pos" holds


def load_tensor_file(path: Path, what: str, fits: Callable[[Any], bool], device: torch.device | str = "cpu") -> Any:
    """A file of the work folder, read without running code: torch's weights-only unpickler (plain
    containers, numbers, strings and tensors only), then `fits` checks the shape of what came back.

    A work folder can come from someone else ("resume from this folder"): a pickle there must never
    run. Anything else, or a damaged file, is a DistillError in one line.
    """
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4": a foreign file, refused below in one line
            warnings.simplefilter("ignore", UserWarning)
            value = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        names = pickle_imports(path)
        if names is None:
            raise DistillError(f"{path} cannot be read as {what} (it is damaged, or not a file SpecDec Studio writes); "
                               "remove it or use an empty work folder.") from None
        asks = f"it asks to run {', '.join(names[:3])}, which is never done" if names else "a foreign pickle"
        raise DistillError(f"{path} is not {what} as SpecDec Studio writes it ({asks}); remove it or use an empty "
                           "work folder.") from None
    except (OSError, RuntimeError, ValueError, EOFError, TypeError, AttributeError, IndexError, KeyError,
            struct.error, OverflowError, NotImplementedError) as e:
        raise DistillError(f"{path} cannot be read as {what} ({type(e).__name__}); remove it or use an empty "
                           "work folder.") from None
    if not fits(value):
        raise DistillError(f"{path} is not {what} as SpecDec Studio writes it; remove it or use an empty work folder.")
    return value


def pickle_imports(path: Path) -> list[str] | None:
    """What a pickle file (or a torch zip archive's data.pkl) imports, read opcode by opcode without running
    it; None when it is no whole pickle (damaged bytes). Only to word a refusal: the file is never loaded."""
    try:
        raw = Path(path).read_bytes()
        if zipfile.is_zipfile(io.BytesIO(raw)):
            with zipfile.ZipFile(io.BytesIO(raw)) as z:
                member = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
                if member is None:
                    return None
                raw = z.read(member)
        names, strings = [], []
        for op, arg, _ in pickletools.genops(raw):
            if op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # noqa: BLE001 - whatever a damaged file raises (zip versions, zlib, struct), it is damaged
        return None
    return [n for n in dict.fromkeys(names) if not n.startswith(("torch.", "collections.OrderedDict"))]


def _is_record(r: Any) -> bool:
    return (isinstance(r, dict) and isinstance(r.get("question"), str) and isinstance(r.get("category"), str)
            and isinstance(r.get("greedy"), bool) and isinstance(r.get("ids"), torch.Tensor) and r["ids"].dim() == 1
            and not r["ids"].is_floating_point() and _count(r.get("prompt_len"))
            and r["prompt_len"] < r["ids"].numel())


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_checkpoint(c: Any) -> bool:
    return (isinstance(c, dict) and isinstance(c.get("head"), dict) and isinstance(c.get("opt"), dict)
            and isinstance(c.get("pos"), dict) and all(_count(c["pos"].get(k)) for k in POSITIONS))


def load_round(path: Path) -> list[dict]:
    """One data round: a list of answer records (question, category, greedy, ids [T] int, prompt_len)."""
    return load_tensor_file(path, "a data round", lambda v: isinstance(v, list) and all(map(_is_record, v)))


def answer_tokens(records: list[dict]) -> int:
    """The answer tokens of a round's records (each one's ids after its prompt)."""
    return sum(len(r["ids"]) - r["prompt_len"] for r in records)


class TrainingPhase:
    """Training methods of a Distiller (which supplies plan, clock, state, _log, _report, _stop_at, _rounds,
    _kept_rounds)."""

    def _sequences(self) -> tuple[list[Sequence], list[Sequence]]:
        """(training, held-out) sequences from every data round, this run's and those kept from earlier runs
        (--data); held out: the first greedy answers of this run by question (answers no earlier head saw)."""
        records = [r for path in self._rounds() for r in load_round(path)]
        if not records:
            raise DistillError("No training data was produced: give the distillation more minutes.")
        greedy = sorted((r for r in records if r["greedy"]), key=lambda r: D.dedupe_key(r["question"]))
        records += [r for path in self._kept_rounds() for r in load_round(path)]
        held = {id(r) for r in greedy[: min(self.plan.eval_sequences, len(greedy) // 5)]}
        train = [Sequence(r["ids"], r["prompt_len"], r["greedy"]) for r in records if id(r) not in held]
        evals = [Sequence(r["ids"], r["prompt_len"], r["greedy"]) for r in records if id(r) in held]
        return train, evals

    def _vocabulary(self, seqs: list[Sequence]) -> torch.Tensor:
        """The draft vocabulary: target ids by frequency in the answers (then by id), EOS included; [Vd] sorted."""
        path = self.work / "vocab.pt"
        if path.exists():
            return load_tensor_file(path, "the draft vocabulary", lambda v: isinstance(v, torch.Tensor) and v.dim() == 1)
        vocab = int(self.target.get_output_embeddings().out_features)
        size = min(self.plan.draft_vocab, vocab)
        counts = torch.zeros(vocab, dtype=torch.float64)
        for s in seqs:
            counts.index_add_(0, s.ids[s.prompt_len :].long(), torch.ones(len(s.ids) - s.prompt_len, dtype=torch.float64))
        if self.init is not None:  # a continued head keeps its vocabulary (its output rows are trained for it)
            d2t = self._init_head().d2t.cpu()
            torch.save(d2t, path)
            coverage = float(counts[d2t].sum() / counts.sum().clamp_min(1))
            self._log({"kind": "vocab", "size": int(d2t.numel()), "answer_coverage": round(coverage, 5),
                       "from": self.init.name}, "train",
                      f"draft vocabulary of {self.init.name}: {d2t.numel()} ids cover {coverage:.2%} of the new answers")
            return d2t
        # Unseen ids: lower ids first (byte-level BPE merges earlier, more frequent pieces first).
        score = counts - torch.arange(vocab, dtype=torch.float64) / vocab
        score[D.eos_ids(self.tokenizer, self.target)] = float("inf")
        d2t = score.topk(size).indices.sort().values
        torch.save(d2t, path)
        coverage = float(counts[d2t].sum() / counts.sum().clamp_min(1))
        self._log({"kind": "vocab", "size": size, "answer_coverage": round(coverage, 5)}, "train",
                  f"draft vocabulary: {size} ids cover {coverage:.2%} of answer tokens")
        return d2t

    def _init_head(self) -> DraftHead:
        """The head a continued run starts from, in float32 (master weights), trainable, unbound."""
        head = load_head(self.init, self.device, torch.float32)
        return head.requires_grad_(True)

    def _build_head(self, d2t: torch.Tensor) -> DraftHead:
        layers = self.plan.layers
        if self.init is not None:
            head = self._init_head()
            if not torch.equal(head.d2t.cpu(), d2t.cpu()):
                raise DistillError(f"The work folder {self.work} has another draft vocabulary than {self.init.name}; "
                                   "use an empty folder.")
            if layers > head.config.layers:  # new layers start as the identity: the head drafts as before
                head = head.grown(layers).requires_grad_(True)
            return head.bind(self.target)
        cfg = self.target.config
        n_heads = cfg.num_attention_heads
        head_cfg = HeadConfig(
            hidden=cfg.hidden_size, n_heads=n_heads, n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
            intermediate=self.plan.intermediate, eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            feature_layers=feature_layers(cfg.num_hidden_layers), draft_vocab=int(d2t.numel()), layers=layers or 1,
        )
        torch.manual_seed(self.plan.seed)
        head = DraftHead(head_cfg, d2t).to(self.device).bind(self.target)
        with torch.no_grad():
            # The output rows expect the target's final-norm scaling: start from it rather than ones.
            head.final_norm.copy_(self.target.model.norm.weight.detach().float())
        return head

    def _train(self, until: float) -> dict:
        plan, cfg = self.plan, self.plan.train
        train_seqs, eval_seqs = self._sequences()
        d2t = self._vocabulary(train_seqs)
        head = self.head = self._build_head(d2t)
        opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        ckpt_path = self.work / "checkpoint.pt"
        pos = {"epoch": 0, "batch": 0, "step": 0, "tokens": 0, "batch_tokens": cfg.batch_tokens}
        if ckpt_path.exists():
            ckpt = load_tensor_file(ckpt_path, "the training checkpoint", _is_checkpoint, self.device)
            try:
                head.load_state_dict(ckpt["head"])
                opt.load_state_dict(ckpt["opt"])
            except (KeyError, RuntimeError, ValueError, TypeError):
                raise DistillError(f"{ckpt_path} does not fit this head; remove it or use an empty work folder.") from None
            pos = ckpt["pos"]
        if self.state["train_started_s"] is None:
            self.state["train_started_s"] = self.clock.used()
        begin = self.state["train_started_s"]
        teacher = Teacher(self.target, head.config.feature_layers)
        compute = torch.bfloat16 if self.device.type == "cuda" else next(self.target.parameters()).dtype
        longest = cfg.max_len + cfg.depth + 2
        cos, sin = head.rope_tables(longest, self.device, compute)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else contextlib.nullcontext()
        last_ckpt = last_eval = time.perf_counter()
        window: list[StepStats] = []
        window_start = time.perf_counter()
        try:
            if pos["step"] == 0 and eval_seqs:  # the untrained head's acceptance: what training is measured against
                self._evaluate(eval_seqs, teacher, cos, sin, pos)
            head.train()
            orders: dict[tuple[int, int], list[list[int]]] = {}  # (epoch, batch tokens) -> batches
            while not self._stop_at(until) and (plan.max_steps is None or pos["step"] < plan.max_steps):
                key = (pos["epoch"], pos["batch_tokens"])
                if key not in orders:
                    orders = {key: batches(train_seqs, pos["batch_tokens"], cfg.max_len,
                                           torch.Generator().manual_seed(plan.seed * 31 + pos["epoch"]))}
                order = orders[key]
                if pos["batch"] >= len(order):
                    pos = {**pos, "epoch": pos["epoch"] + 1, "batch": 0}
                    continue
                ids, lengths, prompt_lens = collate([train_seqs[i] for i in order[pos["batch"]]], cfg.max_len, self.device)
                if plan.max_steps is not None:
                    progress = pos["step"] / plan.max_steps
                else:
                    progress = (self.clock.used() - begin) / max(until - begin, 1.0)
                lr = lr_at(progress, cfg)
                for group in opt.param_groups:
                    group["lr"] = lr
                try:
                    features, normed = teacher(ids, lengths)
                    with autocast:
                        loss, stats = head_loss(head, features, normed, ids, lengths, prompt_lens, cfg, cos, sin)
                    opt.zero_grad(set_to_none=True)
                    if loss.requires_grad:  # a batch whose answers all end at once has nothing to learn
                        loss.backward()
                        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.clip)
                        opt.step()
                except torch.OutOfMemoryError:
                    opt.zero_grad(set_to_none=True)
                    loss = None
                    torch.cuda.empty_cache()
                    smaller = max(pos["batch_tokens"] // 2, cfg.max_len)
                    if smaller == pos["batch_tokens"]:
                        raise
                    log.warning("out of memory at %d tokens per batch; continuing with %d", pos["batch_tokens"], smaller)
                    # The new order is shorter per batch: restart this epoch's batches at the same share.
                    share = pos["batch"] / max(len(order), 1)
                    pos = {**pos, "batch_tokens": smaller}
                    pos["batch"] = int(share * len(batches(train_seqs, smaller, cfg.max_len, torch.Generator())))
                    continue
                pos = {**pos, "batch": pos["batch"] + 1, "step": pos["step"] + 1, "tokens": pos["tokens"] + stats.tokens}
                window.append(stats)
                if pos["step"] % plan.log_every == 0:
                    record = _train_record(window, pos, lr)
                    record["step_s"] = round((time.perf_counter() - window_start) / len(window), 3)
                    self._log(record, "train", _train_message(window, pos))
                    window, window_start = [], time.perf_counter()
                now = time.perf_counter()
                if now - last_eval >= plan.eval_every_s and eval_seqs:
                    self._evaluate(eval_seqs, teacher, cos, sin, pos)
                    last_eval = time.perf_counter()
                if now - last_ckpt >= plan.checkpoint_every_s:
                    self._checkpoint(ckpt_path, opt, pos)
                    last_ckpt = time.perf_counter()
            self._checkpoint(ckpt_path, opt, pos)
            finished = not self.cancel.is_set() and (
                self.clock.used() >= until or (plan.max_steps is not None and pos["step"] >= plan.max_steps))
            acceptance = self._evaluate(eval_seqs, teacher, cos, sin, pos) if eval_seqs else []
        finally:
            teacher.close()
            head.eval()
        if finished:
            self.state["phase"] = "done"
        self.state["step"] = pos["step"]
        return self._export(acceptance, pos, len(train_seqs))

    def _checkpoint(self, path: Path, opt, pos: dict) -> None:
        assert self.head is not None
        tmp = path.with_suffix(".tmp")
        torch.save({"head": self.head.state_dict(), "opt": opt.state_dict(), "pos": pos}, tmp)
        os.replace(tmp, path)
        self._save_state()

    @torch.no_grad()
    def _evaluate(self, seqs: list[Sequence], teacher: Teacher, cos, sin, pos: dict) -> list[float]:
        """Greedy acceptance per draft position on held-out answers (full target vocabulary)."""
        head = self.head
        assert head is not None
        cfg = self.plan.train
        self._report("eval", "measuring acceptance on held-out answers")
        was_training = head.training
        head.eval()
        hits = [0] * cfg.depth
        counts = [0] * cfg.depth
        out = self.target.get_output_embeddings()
        lm_head = out.weight if type(out) is torch.nn.Linear else out  # an 8-bit head is called as it is
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else contextlib.nullcontext()
        for group in batches(seqs, max(cfg.batch_tokens // 2, cfg.max_len), cfg.max_len, torch.Generator().manual_seed(0)):
            ids, lengths, prompt_lens = collate([seqs[i] for i in group], cfg.max_len, self.device)
            features, normed = teacher(ids, lengths)
            with autocast:
                h, c = greedy_acceptance(head, features, normed, lm_head, ids, lengths, prompt_lens, cfg.depth, cos, sin)
            hits = [a + b for a, b in zip(hits, h)]
            counts = [a + b for a, b in zip(counts, c)]
        head.train(was_training)
        acceptance = [h / c if c else 0.0 for h, c in zip(hits, counts)]
        record = {"kind": "eval", "step": pos["step"], "acceptance": [round(a, 4) for a in acceptance],
                  "expected_tokens": {str(k): round(expected_tokens(acceptance, k), 3) for k in range(1, cfg.depth + 1)},
                  "positions": counts[0]}
        self._log(record, "train", "held-out acceptance by position: " + " ".join(f"{a:.2f}" for a in acceptance))
        return acceptance

    def _export(self, acceptance: list[float], pos: dict, sequences: int) -> dict:
        assert self.head is not None
        self._report("export", f"writing the head to {self.out}")
        training = {
            "budget_minutes": self.plan.minutes, "used_minutes": round(self.clock.used() / 60, 2),
            "calls": self.state["calls"], "finished": self.state["phase"] == "done", "steps": pos["step"],
            "trained_tokens": pos["tokens"], "sequences": sequences, "data_rounds": self.state["rounds"],
            "kept_rounds": len(self._kept_rounds()),
            "held_out_acceptance": [round(a, 4) for a in acceptance],
            "expected_tokens_k5": round(expected_tokens(acceptance, 5), 3) if acceptance else None,
            "device": str(self.device), "seed": self.plan.seed,
        }
        init = self.state.get("init")
        if init is not None:  # the budget in all: what the head it continued had used, plus this run
            training["continued_from"] = {"name": init["name"], "used_minutes": init["used_minutes"]}
            training["used_minutes_in_all"] = round(init["used_minutes"] + training["used_minutes"], 2)
        files = save_head(self.head, self.out, name=self.name, target=self.fingerprint, training=training)
        log_copy = self.out / "train_log.jsonl"
        if log_copy.resolve() != self.log_path.resolve():
            earlier = b""
            if self.init is not None and (self.init.folder / "train_log.jsonl").is_file():
                # The whole history in one log: the run continued from, a marker, then this one.
                marker = {"kind": "continue", "from": self.init.name, "used_minutes_before": init["used_minutes"]}
                earlier = ((self.init.folder / "train_log.jsonl").read_bytes().rstrip(b"\n") + b"\n"
                           + json.dumps(marker, ensure_ascii=False).encode() + b"\n")
            log_copy.write_bytes(earlier + self.log_path.read_bytes())
        self._log({"kind": "export", "files": [p.name for p in files], **training}, "export",
                  f"head written to {self.out}")
        return {"out": str(self.out), "files": [str(p) for p in files] + [str(log_copy)], **training}


def _train_record(window: list[StepStats], pos: dict, lr: float) -> dict:
    n = len(window)
    mean = lambda xs: [round(sum(x) / n, 4) for x in zip(*xs)]  # noqa: E731
    return {"kind": "train", "step": pos["step"], "epoch": pos["epoch"], "lr": lr,
            "loss": round(sum(s.loss for s in window) / n, 4), "ce": mean([s.ce for s in window]),
            "reg": mean([s.reg for s in window]), "acc": mean([s.acc for s in window]),
            "tokens": pos["tokens"], "batch_tokens": pos["batch_tokens"]}


def _train_message(window: list[StepStats], pos: dict) -> str:
    n = len(window)
    acc0 = sum(s.acc[0] for s in window) / n
    return f"step {pos['step']}: loss {sum(s.loss for s in window) / n:.3f}, first-draft agreement {acc0:.1%}"
