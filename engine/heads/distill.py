"""`specdec-studio distill`: data, training and export of a draft head within a time budget, resumable.

The budget (minutes of the device, all calls together) is split: about a third writes data
(rounds of Magpie questions and the target's answers), the rest trains, and a reserve at the end
evaluates and exports. Everything lands in a work folder as it is made (data rounds, the draft
vocabulary, checkpoints, the JSON-lines log), so a run that is interrupted, or cut by a per-call
limit (`call_minutes`, for machines lent in slices), continues where it stopped when started
again with the same work folder. Every call ends by exporting the head it has so far.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from engine.errors import EngineError
from engine.heads import data as D
from engine.heads.config import HeadConfig, feature_layers, fingerprint
from engine.heads.model import DraftHead
from engine.heads.shards import save_head
from engine.heads.train import (Sequence, StepStats, Teacher, TrainConfig, batches, collate, expected_tokens,
                                greedy_acceptance, head_loss, lr_at)
from engine.types import TrainingProgress

log = logging.getLogger(__name__)


class DistillError(EngineError):
    """Distillation cannot start or continue (bad work folder, refused prompts, no data)."""


@dataclass(frozen=True)
class DistillPlan:
    minutes: float = 17.0  # the whole budget, all calls together: data, training, evaluation, export
    data_share: float = 0.45  # of the budget spent writing data (more answers beat more epochs)
    reserve_s: float = 30.0  # kept at the end of each call for the last evaluation and the export
    seed: int = 0  # every random choice (seeds, sampling, batch order, initial weights)
    question_batch: int = 1024  # questions sampled per data round (one batched generate; answers likewise)
    question_tokens: int = 160  # longest question
    question_temperature: float = 1.0  # Magpie samples the user turn at T = 1
    question_top_p: float = 0.98
    answer_tokens: int = 320  # longest answer (the benchmarks ask for 256)
    answer_temperature: float = 0.8  # for the sampled rounds
    sampled_share: float = 0.4  # share of data rounds whose answers are sampled rather than greedy
    intermediate: int = 1536  # the head's MLP width (keeps the shipped shards near 45 MB)
    draft_vocab: int = 32768  # most frequent target ids the head can propose
    train: TrainConfig = field(default_factory=TrainConfig)  # optimisation
    eval_sequences: int = 48  # greedy answers held out to measure acceptance
    eval_every_s: float = 75.0  # seconds between evaluations
    checkpoint_every_s: float = 60.0  # seconds between checkpoints
    log_every: int = 10  # training steps between log lines
    max_rounds: int | None = None  # stop writing data after this many rounds (tests; None: by time)
    max_steps: int | None = None  # stop training after this many steps, the schedule following steps (tests)
    questions_must_end: bool = True  # keep only questions the target finished (tiny random models never do)

    def to_json(self) -> dict:
        return asdict(self)


DistillProgress = TrainingProgress  # the engine-wide plain type (engine.types), so views can show it


ProgressFn = Callable[[DistillProgress], None]


class _Clock:
    """Seconds of the budget used, all calls together (what the state file carried in, plus this call)."""

    def __init__(self, spent: float, call_minutes: float | None, started: float | None = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self.spent = spent
        self.call_end = None if call_minutes is None else self.started + call_minutes * 60

    def used(self) -> float:
        return self.spent + time.perf_counter() - self.started

    def call_left(self) -> float:
        return float("inf") if self.call_end is None else self.call_end - time.perf_counter()


class Distiller:
    """One call of a distillation: resumes from `work`, runs until the budget or the call ends, exports to `out`."""

    def __init__(self, target, tokenizer, *, work: Path, out: Path, plan: DistillPlan, name: str,
                 call_minutes: float | None = None, extra_questions: list[str] = (),
                 progress: ProgressFn | None = None, cancel: threading.Event | None = None,
                 started: float | None = None) -> None:
        """started: time.perf_counter() when this call began (loading the target counts against the budget)."""
        self.target = target
        self.tokenizer = tokenizer
        self.work = work
        self.out = out
        self.plan = plan
        self.name = name
        self.progress = progress or (lambda p: None)
        self.cancel = cancel or threading.Event()
        self.device = next(target.parameters()).device
        self.fingerprint = fingerprint(target)
        self.refusals = D.Refusals(D.packaged_refusals())
        for q in extra_questions:
            hit = self.refusals.match(q)
            if hit is not None:
                raise DistillError(f"Refusing to train on a benchmark or test prompt: {q[:80]!r} matches {hit[:80]!r}.")
        self.extra_questions = list(extra_questions)
        work.mkdir(parents=True, exist_ok=True)
        (work / "data").mkdir(exist_ok=True)
        self.state = self._load_state()
        self.clock = _Clock(self.state["spent_s"], call_minutes, started)
        self.log_path = work / "train_log.jsonl"
        self.head: DraftHead | None = None

    # -- state ------------------------------------------------------------------------------------

    def _load_state(self) -> dict:
        path = self.work / "state.json"
        fresh = {"fingerprint": self.fingerprint.to_json(), "plan": self.plan.to_json(), "spent_s": 0.0,
                 "phase": "data", "rounds": 0, "train_started_s": None, "step": 0, "calls": 0}
        if not path.exists():
            return fresh
        state = json.loads(path.read_text(encoding="utf-8"))
        if state.get("fingerprint") != fresh["fingerprint"]:
            raise DistillError(f"The work folder {self.work} belongs to another target; use an empty folder.")
        if state.get("plan") != fresh["plan"]:
            raise DistillError(f"The work folder {self.work} was started with other settings (minutes, seed, "
                               "sizes); continue with the same ones or use an empty folder.")
        return state

    def _save_state(self) -> None:
        self.state["spent_s"] = self.clock.used()
        tmp = self.work / "state.json.tmp"
        tmp.write_text(json.dumps(self.state, indent=2), encoding="utf-8")
        os.replace(tmp, self.work / "state.json")

    def _log(self, record: dict, phase: str, message: str) -> None:
        record = {"time_s": round(self.clock.used(), 1), **record}
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._report(phase, message, record)

    def _report(self, phase: str, message: str, record: dict | None = None) -> None:
        budget = self.plan.minutes * 60
        eta = min(budget - self.clock.used(), self.clock.call_left())
        self.progress(DistillProgress(phase, min(self.clock.used() / budget, 1.0), max(eta, 0.0), message, record))

    def _stop_at(self, budget_point: float) -> bool:
        """True once the budget reaches `budget_point` seconds, the call is about to end, or cancel is set."""
        return (self.cancel.is_set() or self.clock.used() >= budget_point
                or self.clock.call_left() <= self.plan.reserve_s)

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> dict:
        """Continues the distillation; returns a summary of this call (the head is exported to `out`)."""
        self.state["calls"] += 1
        self._log({"kind": "call", "call": self.state["calls"], "phase": self.state["phase"]}, "load",
                   f"call {self.state['calls']}: resuming at {self.state['phase']}")
        budget = self.plan.minutes * 60
        if self.state["phase"] == "data":
            self._data(budget * self.plan.data_share)
            if not self.cancel.is_set() and self.clock.call_left() > self.plan.reserve_s:
                self.state["phase"] = "train"
            self._save_state()
        summary: dict = {"phase": self.state["phase"]}
        if self.state["phase"] in ("train", "done"):
            summary = self._train(budget - self.plan.reserve_s)
        self._save_state()
        self._report("done", f"stopped at {self.state['phase']} after {self.clock.used() / 60:.1f} min of the budget")
        return summary

    # -- data -------------------------------------------------------------------------------------

    def _generate_time(self) -> float | None:
        """Seconds one generate call may take before this call's reserve (None: no call limit)."""
        left = self.clock.call_left()
        return None if left == float("inf") else max(left - self.plan.reserve_s - 5.0, 5.0)

    def _rounds(self) -> list[Path]:
        return sorted((self.work / "data").glob("round-*.pt"))

    def _data(self, until: float) -> None:
        plan = self.plan
        seen = set()
        for path in self._rounds():
            seen.update(D.dedupe_key(r["question"]) for r in torch.load(path, weights_only=False))
        last = 0.0  # seconds the last round took: a round is not started if it would overrun
        while True:
            r = self.state["rounds"]
            if plan.max_rounds is not None and r >= plan.max_rounds:
                break
            if r > 0 and (self._stop_at(until - last) or self.clock.call_left() - last <= plan.reserve_s):
                break
            self._report("data", f"data round {r + 1}: sampling questions")
            started = time.perf_counter()
            rng = torch.Generator().manual_seed(plan.seed * 1000003 + r)
            questions, stats = self._questions(r, rng, seen)
            # Round 0 is greedy (held-out acceptance is measured on greedy answers), then by share.
            greedy = int((r + 1) * plan.sampled_share) == int(r * plan.sampled_share)
            self._report("data", f"data round {r + 1}: answering {len(questions)} questions "
                                 f"({'greedy' if greedy else 'sampled'})")
            records = self._answers(questions, greedy, rng, seed=plan.seed * 1000003 + r)
            tmp = self.work / "data" / f".round-{r:05d}.pt.tmp"
            torch.save(records, tmp)
            os.replace(tmp, self.work / "data" / f"round-{r:05d}.pt")
            self.state["rounds"] = r + 1
            self._save_state()
            tokens = sum(len(x["ids"]) - x["prompt_len"] for x in records)
            last = time.perf_counter() - started
            self._log({"kind": "data", "round": r + 1, **stats, "answers": len(records), "answer_tokens": tokens,
                       "greedy": greedy, "seconds": round(time.perf_counter() - started, 1)},
                      "data", f"data round {r + 1}: {len(records)} answers, {tokens} tokens")

    def _questions(self, r: int, rng: torch.Generator, seen: set[str]) -> tuple[list[tuple[str, str]], dict]:
        """(category, question) pairs for round r: sampled user turns, filtered, deduplicated, not refused."""
        plan, tok = self.plan, self.tokenizer
        seeds = list(D.pick_seeds(plan.question_batch, rng))
        prompts = [tok(D.user_turn_prefix(tok, s.system), add_special_tokens=False)["input_ids"] for s in seeds]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch well
        outs = D.sample_batches(self.target, tok, [prompts[i] for i in order], max_new=plan.question_tokens,
                              temperature=plan.question_temperature, top_p=plan.question_top_p,
                              seed=plan.seed * 7919 + r, max_time=self._generate_time())
        kept: list[tuple[str, str]] = []
        counts = Counter()
        if r == 0:
            for q in self.extra_questions:
                seen.add(D.dedupe_key(q))
                kept.append(("given", q))
        for i, (ids, ended) in zip(order, outs):
            if not ended and plan.questions_must_end:
                counts["unfinished"] += 1
                continue
            text = D.clean_question(tok.decode(ids, skip_special_tokens=True))
            if text is None:
                counts["rejected"] += 1
                continue
            if self.refusals.match(text) is not None:
                counts["refused"] += 1
                continue
            key = D.dedupe_key(text)
            if key in seen:
                counts["duplicates"] += 1
                continue
            seen.add(key)
            kept.append((seeds[i].category, text))
        return kept, {"sampled": len(seeds), "kept": len(kept), **counts}

    def _answers(self, questions: list[tuple[str, str]], greedy: bool, rng: torch.Generator, seed: int) -> list[dict]:
        plan, tok = self.plan, self.tokenizer
        if not questions:
            return []
        prompts = [D.answer_prompt(tok, q, D.pick_answer_system(rng)) for _, q in questions]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        outs = D.sample_batches(self.target, tok, [prompts[i] for i in order], max_new=plan.answer_tokens,
                              temperature=0.0 if greedy else plan.answer_temperature, top_p=1.0, seed=seed,
                              max_time=self._generate_time())
        records = []
        for i, (ids, _) in zip(order, outs):
            if len(ids) < 2:
                continue
            records.append({"question": questions[i][1], "category": questions[i][0], "greedy": greedy,
                            "ids": torch.tensor(prompts[i] + ids, dtype=torch.int32), "prompt_len": len(prompts[i])})
        return records

    # -- training ---------------------------------------------------------------------------------

    def _sequences(self) -> tuple[list[Sequence], list[Sequence]]:
        """(training, held-out) sequences from every data round; held out: the first greedy answers by question."""
        records = [r for path in self._rounds() for r in torch.load(path, weights_only=False)]
        if not records:
            raise DistillError("No training data was produced: give the distillation more minutes.")
        greedy = sorted((r for r in records if r["greedy"]), key=lambda r: D.dedupe_key(r["question"]))
        held = {id(r) for r in greedy[: min(self.plan.eval_sequences, len(greedy) // 5)]}
        train = [Sequence(r["ids"], r["prompt_len"], r["greedy"]) for r in records if id(r) not in held]
        evals = [Sequence(r["ids"], r["prompt_len"], r["greedy"]) for r in records if id(r) in held]
        return train, evals

    def _vocabulary(self, seqs: list[Sequence]) -> torch.Tensor:
        """The draft vocabulary: target ids by frequency in the answers (then by id), EOS included; [Vd] sorted."""
        path = self.work / "vocab.pt"
        if path.exists():
            return torch.load(path)
        vocab = int(self.target.get_output_embeddings().weight.shape[0])
        size = min(self.plan.draft_vocab, vocab)
        counts = torch.zeros(vocab, dtype=torch.float64)
        for s in seqs:
            counts.index_add_(0, s.ids[s.prompt_len :].long(), torch.ones(len(s.ids) - s.prompt_len, dtype=torch.float64))
        # Unseen ids: lower ids first (byte-level BPE merges earlier, more frequent pieces first).
        score = counts - torch.arange(vocab, dtype=torch.float64) / vocab
        score[D.eos_ids(self.tokenizer, self.target)] = float("inf")
        d2t = score.topk(size).indices.sort().values
        torch.save(d2t, path)
        coverage = float(counts[d2t].sum() / counts.sum().clamp_min(1))
        self._log({"kind": "vocab", "size": size, "answer_coverage": round(coverage, 5)}, "train",
                  f"draft vocabulary: {size} ids cover {coverage:.2%} of answer tokens")
        return d2t

    def _build_head(self, d2t: torch.Tensor) -> DraftHead:
        cfg = self.target.config
        n_heads = cfg.num_attention_heads
        head_cfg = HeadConfig(
            hidden=cfg.hidden_size, n_heads=n_heads, n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
            intermediate=self.plan.intermediate, eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            feature_layers=feature_layers(cfg.num_hidden_layers), draft_vocab=int(d2t.numel()),
        )
        torch.manual_seed(self.plan.seed)
        return DraftHead(head_cfg, d2t).to(self.device).bind(self.target)

    def _train(self, until: float) -> dict:
        plan, cfg = self.plan, self.plan.train
        train_seqs, eval_seqs = self._sequences()
        d2t = self._vocabulary(train_seqs)
        head = self.head = self._build_head(d2t)
        opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        ckpt_path = self.work / "checkpoint.pt"
        pos = {"epoch": 0, "batch": 0, "step": 0, "tokens": 0, "batch_tokens": cfg.batch_tokens}
        if ckpt_path.exists():
            ckpt = torch.load(ckpt_path, map_location=self.device, weights_only=False)
            head.load_state_dict(ckpt["head"])
            opt.load_state_dict(ckpt["opt"])
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
                    self._log(_train_record(window, pos, lr), "train", _train_message(window, pos))
                    window = []
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
        lm_head = self.target.get_output_embeddings().weight
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
            "held_out_acceptance": [round(a, 4) for a in acceptance],
            "expected_tokens_k5": round(expected_tokens(acceptance, 5), 3) if acceptance else None,
            "device": str(self.device), "seed": self.plan.seed,
        }
        files = save_head(self.head, self.out, name=self.name, target=self.fingerprint, training=training)
        log_copy = self.out / "train_log.jsonl"
        if log_copy.resolve() != self.log_path.resolve():
            log_copy.write_bytes(self.log_path.read_bytes())
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



def prepare(target: str | None, out: Path, *, minutes: float, work: Path | None = None,
            call_minutes: float | None = None, device: str = "auto", dtype: str = "auto", seed: int = 0,
            questions: list[str] = (), plan: DistillPlan | None = None, progress: ProgressFn | None = None,
            cancel: threading.Event | None = None) -> Distiller:
    """Loads the target (as the store loads any model) and prepares one call of its distillation.

    The work folder defaults to OUT/work; preparing and running again with it continues the run.
    Loading counts against the budget.
    """
    started = time.perf_counter()
    from engine.models.store import load_pair

    plan = replace(plan or DistillPlan(), minutes=minutes, seed=seed)
    report = progress or (lambda p: None)
    report(DistillProgress("load", 0.0, minutes * 60, "loading the target"))
    pair = load_pair(target, None, device=device, dtype=dtype, with_draft=False)
    if pair.target.device.type == "cpu":
        log.warning("distilling on the CPU: data and training are slow; expect a weak head in a short budget")
    return Distiller(pair.target, pair.tokenizer, work=work or out / "work", out=out, plan=plan,
                     name=f"{pair.info.target_name} head", call_minutes=call_minutes,
                     extra_questions=list(questions), progress=progress, cancel=cancel, started=started)


def distill(target: str | None, out: Path, **options) -> dict:
    """`specdec-studio distill`: prepare (see there for the options) and run one call; its summary."""
    return prepare(target, out, **options).run()
