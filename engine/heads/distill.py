"""`specdec-studio distill`: data, training and export of a draft head within a time budget, resumable.

The budget (minutes of the device, all calls together) is split: about a third writes data
(rounds of Magpie questions and the target's answers), the rest trains, and a reserve at the end
evaluates and exports. Everything lands in a work folder as it is made (data rounds, the draft
vocabulary, checkpoints, the JSON-lines log), so a run that is interrupted, or cut by a per-call
limit (`call_minutes`, for machines lent in slices), continues where it stopped when started
again with the same work folder. Every call ends by exporting the head it has so far.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path


from engine.errors import IncompatibleModelsError, ModelLoadError
from engine.heads import data as D
from engine.heads.config import fingerprint
from engine.heads.fitting import DistillError, TrainingPhase, answer_tokens, load_round
from engine.heads.model import DraftHead
from engine.heads.reuse import KeptData, check_kept, find_all_kept
from engine.heads.shards import MANIFEST, HeadFiles, open_head, read_manifest
from engine.heads.train import TrainConfig
from engine.heads.writing import DataPhase
from engine.types import TrainingProgress
from engine.loadspec import LoadSpec
from engine.models.loader import load_pair

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillPlan:
    minutes: float = 17.0  # the whole budget, all calls together: data, training, evaluation, export
    data_share: float = 0.45  # of the budget spent writing data (more answers beat more epochs)
    reserve_s: float = 30.0  # kept at the end of each call for the last evaluation and the export
    seed: int = 0  # every random choice (seeds, sampling, batch order, initial weights)
    question_batch: int = 4096  # questions per data round (large: each batch of answers ends on its few longest)
    question_tokens: int = 160  # longest question
    question_temperature: float = 1.0  # Magpie samples the user turn at T = 1
    question_top_p: float = 0.98
    answer_tokens: int = 1024  # longest answer (the benchmarks ask for 256; long answers teach long contexts)
    answer_temperature: float = 0.8  # for the sampled rounds
    sampled_share: float = 0.4  # share of data rounds whose answers are sampled rather than greedy
    intermediate: int = 1536  # the head's MLP width (keeps the shipped shards near 45 MB)
    draft_vocab: int = 32768  # most frequent target ids the head can propose
    layers: int = 0  # the head's decoder layers; 0: one for a new head, as many as a continued head has
    # (more than it has: the continued head grows new layers that start as the identity)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_len=1536))  # optimisation
    eval_sequences: int = 48  # greedy answers held out to measure acceptance
    eval_every_s: float = 75.0  # seconds between evaluations
    checkpoint_every_s: float = 60.0  # seconds between checkpoints
    log_every: int = 10  # training steps between log lines
    max_rounds: int | None = None  # stop writing data after this many rounds (tests; None: by time)
    max_steps: int | None = None  # stop training after this many steps, the schedule following steps (tests)
    questions_must_end: bool = True  # keep only questions the target finished (tiny random models never do)
    answer_segment: int = 0  # answer in segments of this many tokens, dropping finished rows between them (0: one)
    rows: int = 256  # sequences decoded at once by continuous batching (engine/heads/generate.py); 0: HF generate
    followup_share: float = 0.3  # share of finished answers that get a second user turn and its answer

    def to_json(self) -> dict:
        return asdict(self)


DistillProgress = TrainingProgress  # the engine-wide plain type (engine.types), so views can show it


ProgressFn = Callable[[DistillProgress], None]


# On a CPU a 4,096-question round or a 16k-token batch takes a very long time: everything smaller.
CPU_PLAN = DistillPlan(question_batch=64, question_tokens=96, answer_tokens=192, eval_sequences=16, rows=16,
                       eval_every_s=600.0, checkpoint_every_s=300.0, log_every=2,
                       train=TrainConfig(depth=4, batch_tokens=2048, max_len=320))


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


class Distiller(DataPhase, TrainingPhase):
    """One call of a distillation: resumes from `work`, runs until the budget or the call ends, exports to `out`."""

    def __init__(self, target, tokenizer, *, work: Path, out: Path, plan: DistillPlan, name: str,
                 call_minutes: float | None = None, extra_questions: list[str] = (),
                 progress: ProgressFn | None = None, cancel: threading.Event | None = None,
                 started: float | None = None, init: HeadFiles | None = None, data: list[Path] = ()) -> None:
        """started: time.perf_counter() when this call began (loading the target counts against the budget).

        init: a head already trained for this target to continue from (its vocabulary and weights);
        the new data is fresh, and the budget it used before is carried into the summary.
        data: work folders of earlier distillations of this target whose rounds are trained on beside the
        fresh ones (engine/heads/reuse.py).
        """
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
        self.kept: list[KeptData] = find_all_kept(list(data), work)
        check_kept(self.kept, self.fingerprint.to_json())
        self.refusals = D.Refusals(D.packaged_refusals())
        for q in extra_questions:
            hit = self.refusals.match(q)
            if hit is not None:
                raise DistillError(f"Refusing to train on a benchmark or test prompt: {q[:80]!r} matches {hit[:80]!r}.")
        self.extra_questions = list(extra_questions)
        self.init = init
        if init is not None and 0 < plan.layers < init.config.layers:
            raise DistillError(f"{init.name} has {init.config.layers} decoder layers; a continued head keeps them "
                               f"(--plan layers={plan.layers} would drop some).")
        self.data_seed = data_seed(plan.seed, init, self.kept)
        work.mkdir(parents=True, exist_ok=True)
        (work / "data").mkdir(exist_ok=True)
        self.state = self._load_state()
        self.clock = _Clock(self.state["spent_s"], call_minutes, started)
        self.log_path = work / "train_log.jsonl"
        self.head: DraftHead | None = None
        self.sampler = None  # the data phase's continuous batching (engine/heads/writing.py), when the target allows

    # -- state ------------------------------------------------------------------------------------

    def _load_state(self) -> dict:
        path = self.work / "state.json"
        fresh = {"fingerprint": self.fingerprint.to_json(), "plan": self.plan.to_json(), "spent_s": 0.0,
                 "phase": "data", "rounds": 0, "train_started_s": None, "step": 0, "calls": 0,
                 "init": None if self.init is None else init_record(self.init),
                 "kept": [str(k.work) for k in self.kept]}
        if not path.exists():
            return fresh
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            raise DistillError(f"{path} is damaged (not JSON SpecDec Studio wrote); use an empty work folder.") from None
        if not _is_state(state):
            raise DistillError(f"{path} is not a distillation state SpecDec Studio wrote; use an empty work folder.")
        if state.get("fingerprint") != fresh["fingerprint"]:
            raise DistillError(f"The work folder {self.work} belongs to another target; use an empty folder.")
        if state.get("plan") != fresh["plan"]:
            raise DistillError(f"The work folder {self.work} was started with other settings (minutes, seed, "
                               "sizes); continue with the same ones or use an empty folder.")
        if state.get("init") != fresh["init"]:
            raise DistillError(f"The work folder {self.work} was started from another head (--init); "
                               "continue with the same one or use an empty folder.")
        if state.get("kept", []) != fresh["kept"]:
            raise DistillError(f"The work folder {self.work} was started with other --data folders; "
                               "continue with the same ones or use an empty folder.")
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

    def _kept_rounds(self) -> list[Path]:
        return [path for k in self.kept for path in k.rounds]

    def _log_kept(self) -> None:
        """The kept rounds' own "data" records (as their run logged them), each marked with where it was kept."""
        for k in self.kept:
            for path in k.rounds:
                number = int(path.stem.rsplit("-", 1)[1]) + 1
                record = k.logged.get(number)
                if record is None:  # that run's log is gone: what the round itself says
                    records = load_round(path)
                    record = {"kind": "data", "round": number, "answers": len(records),
                              "answer_tokens": answer_tokens(records)}
                record = {key: value for key, value in record.items() if key != "time_s"}
                self._log({**record, "kept_from": k.work.name}, "data",
                          f"kept round {number} of {k.work.name}: {record.get('answer_tokens', 0)} answer tokens")

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
        if self.state["calls"] == 1:
            self._log_kept()
        budget = self.plan.minutes * 60
        if self.state["phase"] == "data":
            if self._data(budget * self.plan.data_share):
                self.state["phase"] = "train"
            self._save_state()
        summary: dict = {"phase": self.state["phase"]}
        if self.state["phase"] in ("train", "done"):
            summary = self._train(budget - self.plan.reserve_s)
        self._save_state()
        self._report("done", f"stopped at {self.state['phase']} after {self.clock.used() / 60:.1f} min of the budget")
        return summary


def _is_state(state: object) -> bool:
    """The state file's fields have the types this module writes (a foreign or edited file is refused)."""
    if not isinstance(state, dict):
        return False
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0  # noqa: E731
    count = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
    return (number(state.get("spent_s")) and state.get("phase") in ("data", "train", "done")
            and count(state.get("rounds")) and count(state.get("step")) and count(state.get("calls"))
            and (state.get("train_started_s") is None or number(state.get("train_started_s"))))


def data_seed(seed: int, init: HeadFiles | None, kept: list[KeptData] = ()) -> int:
    """The seed of a run's questions and answers: the plan's, mixed with the head a continued run starts from
    and with the rounds kept from earlier runs (--data: their names and sizes).

    A run continued from a head with the seed that head was trained with would otherwise write the very
    questions and answers of the run before (the target is deterministic): a second epoch, not fresh data.
    A run given the rounds of one with its own seed would write only questions it must drop as seen.
    """
    if init is None and not kept:
        return seed
    shards = "".join(s.get("sha256", "") for s in init.manifest.get("shards", [])) if init is not None else ""
    rounds = ",".join(f"{p.name}={p.stat().st_size}" for k in kept for p in k.rounds)
    text = f"{seed}:{shards}" + (f":{rounds}" if rounds else "")  # a continued run alone: as it always was
    digest = hashlib.sha256(text.encode()).hexdigest()
    return int(digest[:8], 16)  # 32 bits: times the round multipliers it stays a valid torch seed


def init_record(files: HeadFiles) -> dict:
    """What a continued run keeps of the head it starts from: where, which, and the budget it used."""
    training = files.manifest.get("training") or {}
    before = training.get("used_minutes_in_all", training.get("used_minutes", 0.0))
    return {"folder": str(files.folder), "name": files.name,
            "shards": [s["sha256"] for s in files.manifest.get("shards", [])],
            "used_minutes": float(before or 0.0)}


POSITIVE = ("question_batch", "question_tokens", "answer_tokens", "intermediate", "draft_vocab", "eval_sequences",
            "log_every", "depth", "batch_tokens", "max_len", "max_rounds", "max_steps")  # sizes: 0 is a typo
SHARES = ("data_share", "sampled_share", "followup_share", "warmup", "final_lr", "step_decay")  # fractions of 1
# Beyond these a value is a typo that would fail (or fill the memory) only after the target loaded.
UPPER = {"question_batch": 16384, "question_tokens": 4096, "answer_tokens": 16384, "intermediate": 65536,
         "draft_vocab": 1 << 20, "eval_sequences": 100_000, "log_every": 1_000_000, "depth": 16,
         "batch_tokens": 1 << 21, "max_len": 32768, "answer_segment": 16384, "lr": 1.0, "reg_weight": 100.0,
         "question_temperature": 10.0, "answer_temperature": 10.0, "question_top_p": 1.0, "clip": 1e6,
         "rows": 8192, "layers": 8}
MAX_QUESTION_CHARS = 32_000  # a given question longer than this is not a question (a pasted file, a typo)


def plan_with(plan: DistillPlan, changes: dict[str, str]) -> DistillPlan:
    """The plan with fields changed by name ("answer_segment", "train.lr"), each value parsed as the field's type.

    ValueError (one line) for an unknown name or a value of the wrong type.
    """
    top: dict = {}
    train: dict = {}
    for key, text in changes.items():
        holder, name = (plan.train, key[6:]) if key.startswith("train.") else (plan, key)
        kinds = {f.name: f.type for f in fields(holder)}
        if name not in kinds or name in ("train", "minutes", "seed"):
            known = sorted(k for k in kinds if k not in ("train", "minutes", "seed"))
            prefix = "train." if holder is plan.train else ""
            raise ValueError(f"unknown plan setting {key!r}; known: {', '.join(prefix + k for k in known)}")
        current = getattr(holder, name)
        kind = type(current) if current is not None else int
        try:
            if kind is bool:
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                value = text.lower() in ("true", "1")
            else:
                value = kind(text)
        except ValueError:
            raise ValueError(f"plan setting {key}={text!r}: expected {kind.__name__}") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            low = 1 if name in POSITIVE else 0
            high = min(1 if name in SHARES else math.inf, UPPER.get(name, math.inf))
            if not (math.isfinite(value) and low <= value <= high):
                raise ValueError(f"plan setting {key}={text!r}: expected a number from {low} to {high:g}")
        (train if holder is plan.train else top)[name] = value
    return replace(plan, **top, train=replace(plan.train, **train))


def prepare(target: str | None, out: Path, *, minutes: float, work: Path | None = None,
            call_minutes: float | None = None, device: str = "auto", dtype: str = "auto", seed: int = 0,
            questions: list[str] = (), plan: DistillPlan | None = None, progress: ProgressFn | None = None,
            cancel: threading.Event | None = None, init: Path | None = None,
            plan_changes: dict[str, str] | None = None, data: list[Path] = ()) -> Distiller:
    """Loads the target (as the store loads any model) and prepares one call of its distillation.

    The work folder defaults to OUT/work; preparing and running again with it continues the run.
    Loading counts against the budget. init: a head folder for this target to continue training
    (refused, as at load, when it was trained for another target). plan_changes: see plan_with.
    data: work folders of earlier runs for this target whose data rounds are trained on again (reuse.py).
    """
    started = time.perf_counter()
    # Cheap checks first: a bad setting or question should not cost a model load.
    try:
        plan_with(plan or DistillPlan(), plan_changes or {})
    except ValueError as e:
        raise DistillError(str(e)) from None
    check_questions(questions)
    check_out(out, work or out / "work")
    find_all_kept(list(data), work or out / "work")  # the folders' shape; their target is checked once it loads
    if init is not None:
        check_init(Path(init))
    report = progress or (lambda p: None)
    report(DistillProgress("load", 0.0, minutes * 60, "loading the target"))
    pair = load_pair(LoadSpec(target, None, with_draft=False, device=device, dtype=dtype))
    if plan is None and pair.target.device.type == "cpu":
        log.warning("distilling on the CPU: data and training are slow; expect a weak head in a short budget")
        plan = CPU_PLAN  # small rounds and batches, so progress shows every few minutes at least
    plan = replace(plan or DistillPlan(), minutes=minutes, seed=seed)
    if plan_changes:
        plan = plan_with(plan, plan_changes)
    files = None
    if init is not None:
        try:
            files = open_head(Path(init), pair.target)
        except (ModelLoadError, IncompatibleModelsError) as e:
            raise DistillError(f"Cannot continue from {init}: {e}") from None
    name = files.name if files is not None else f"{pair.info.target_name} head"  # a continued head keeps its name
    return Distiller(pair.target, pair.tokenizer, work=work or out / "work", out=out, plan=plan,
                     name=name, call_minutes=call_minutes,
                     extra_questions=list(questions), progress=progress, cancel=cancel, started=started, init=files,
                     data=list(data))


def check_out(out: Path, work: Path) -> None:
    """DistillError (one line) when OUT holds a draft head this run did not start (no state in its work folder):
    the export deletes a folder's shards and rewrites its manifest, so a new run there would replace that head."""
    if (Path(out) / MANIFEST).is_file() and not (Path(work) / "state.json").exists():
        raise DistillError(f"{out} already holds a draft head; a new run would replace it: save the new head in "
                           "another folder (to train that head further, start from it: --init, or Start from).")


def check_init(init: Path) -> None:
    """DistillError (one line) when the folder a run continues from holds no readable head; whether the head
    fits the target is checked once the target loads (prepare)."""
    try:
        read_manifest(init)
    except ModelLoadError as e:
        raise DistillError(f"Cannot continue from {init}: {e}") from None


def check_questions(questions: list[str]) -> None:
    """DistillError (one line) for a given question that is too long or a refused benchmark/test prompt."""
    refusals = D.Refusals(D.packaged_refusals()) if questions else None
    for q in questions:
        if len(q) > MAX_QUESTION_CHARS:
            raise DistillError(f"A given question has {len(q):,} characters (at most {MAX_QUESTION_CHARS:,}): "
                               f"{q[:60]!r}…; is it a whole file?")
        hit = refusals.match(q)
        if hit is not None:
            raise DistillError(f"Refusing to train on a benchmark or test prompt: {q[:80]!r} matches {hit[:80]!r}.")


def distill(target: str | None, out: Path, **options) -> dict:
    """`specdec-studio distill`: prepare (see there for the options) and run one call; its summary."""
    return prepare(target, out, **options).run()
