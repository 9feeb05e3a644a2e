"""The engine worker: a QObject on a long-lived QThread that keeps the models resident and decodes."""
from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

from app.core.failures import first_line, generation_error_message, load_error_message, training_error_message
from app.core.session import TrainRequest
from app.ui.collector import collector
from app.ui.cost_refresh import CostRefresh
from engine import garbage
from engine.loadspec import LoadSpec
from engine.measure.stats import summarize
from engine.types import GenerationRequest, ModelInfo, PrefillProgress, Step

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.03  # steps reach the UI at most ~33 times a second, whatever the token rate
SHUTDOWN_WAIT_S = 10.0  # how long closing the window waits for the worker thread

# Every worker thread ever started, so tests can fail on one left running (napari-style).
_threads: weakref.WeakSet[QThread] = weakref.WeakSet()
_orphans: list[QObject] = []  # hosts whose thread would not stop in time


def running_threads() -> list[QThread]:
    """Worker threads still running; empty after every window has closed."""
    return [t for t in list(_threads) if t.isRunning()]


class EngineLike(Protocol):
    info: ModelInfo

    def generate(self, request: GenerationRequest, cancel: threading.Event,
                 progress: Callable[[PrefillProgress], None] | None = None) -> Any: ...


ProgressCallback = Callable[[Any], None]
EngineFactory = Callable[[LoadSpec, ProgressCallback], EngineLike]
# (request, engine in use) -> (bytes the new pair will hold, bytes free for it beside the old one);
# None where it cannot tell, and then the old pair is kept while the new one loads (off the CPU).
RoomCheck = Callable[[LoadSpec, EngineLike], tuple[int | None, int | None]]
RELEASE_STAGES = ("convert", "load")  # the first stages that need memory: checks and downloads come before


@dataclass(frozen=True)
class WorkerNotice:
    """A load stage the worker itself reports (same fields as engine.loadspec.LoadProgress)."""

    stage: str  # "release"
    fraction: float  # 0..1
    message: str  # one line for the status bar


class LoadCancelled(Exception):
    """Raised from the progress callback between load stages when the app is closing."""


def default_engine_factory(request: LoadSpec, progress: ProgressCallback) -> EngineLike:
    """The engine on the runtime the request asks for (tokenizers checked first, then weights)."""
    from engine.assemble import build_engine

    return build_engine(request, progress)


def measure_room(request: LoadSpec, engine: EngineLike) -> tuple[int | None, int | None]:
    """The new pair's size from its files' headers, and the memory free beside the pair in use."""
    from engine.models import memory

    try:
        need = memory.pair_bytes(request.target, request.draft, with_draft=request.with_draft,
                                 device=request.device, dtype=request.dtype)
    except Exception as e:  # an estimate is advice; the load itself reports real problems
        log.info("no memory estimate for the new pair: %s", e)
        return None, None
    if need is None:  # not converted yet, or a hub model: guess it is as big as the pair in use
        need = memory.model_bytes(getattr(engine, "target", None), getattr(engine, "draft", None)) or None
    free = memory.available_bytes()
    return need, None if free is None else free - memory.headroom_bytes()


def _no_room_check(_request: LoadSpec, _engine: EngineLike) -> tuple[None, None]:
    return None, None


def _both_on_cpu(request: LoadSpec, engine: EngineLike) -> bool:
    """The pair in use and the new one both live in host memory (loading one beside the other doubles it)."""
    if not str(engine.info.device).startswith("cpu"):
        return False
    if request.device != "auto":
        return request.device == "cpu"
    from engine.models.device import pick_device

    return pick_device("auto").type == "cpu"


# (request, engine, progress, cancel) -> (summary, ModelInfo with the new head, or None when none trained)
HeadTrainer = Callable[[TrainRequest, EngineLike, ProgressCallback, threading.Event], tuple[dict, ModelInfo | None]]


def default_head_trainer(request: TrainRequest, engine: EngineLike, progress: ProgressCallback,
                         cancel: threading.Event) -> tuple[dict, ModelInfo | None]:
    """Distils a head for the loaded target (training loads a second copy of it) and attaches the result."""
    from pathlib import Path

    from engine.heads.distill import prepare

    distiller = prepare(request.target, Path(request.out), minutes=request.minutes, device=request.device,
                        dtype=request.dtype, progress=progress, cancel=cancel,
                        init=Path(request.init) if request.init else None, data=[Path(d) for d in request.data])
    summary = distiller.run()
    head = distiller.head
    if head is None or not summary.get("steps"):
        return summary, None
    dtype = next(engine.target.parameters()).dtype  # type: ignore[attr-defined]
    engine.attach_head(head.to(dtype=dtype).eval().requires_grad_(False), distiller.name)  # type: ignore[attr-defined]
    return summary, engine.info


class EngineWorker(QObject):
    """Owns the engine; every slot runs on the worker thread, every signal names its request.

    Exactly one terminal signal per generation (finished or failed), cancellations included.
    Steps are batched here (at most one `steps` signal per FLUSH_INTERVAL_S) so that 1,000 tok/s
    does not turn into 1,000 queued events a second on the UI thread.
    """

    # UI -> worker (queued: emitted on the UI thread, run on the worker thread)
    load_requested = Signal(object)  # LoadSpec
    generate_requested = Signal(object)  # GenerationRequest (request_id set)
    # worker -> UI
    load_started = Signal(object)  # LoadSpec
    load_progress = Signal(object)  # engine.loadspec.LoadProgress
    load_finished = Signal(object)  # ModelInfo of the pair now in use
    load_failed = Signal(str)  # one-line message; the previous engine stays in use (or was loaded again)
    engine_released = Signal(str)  # the pair in use was released to make room for a new one; says why
    release_requested = Signal(str)  # UI -> worker: let the pair go, saying why (the chat uses a remote server)
    generation_started = Signal(int)  # request_id
    prefill_progress = Signal(int, object)  # request_id, engine.types.PrefillProgress (between prompt chunks)
    steps = Signal(int, object)  # request_id, tuple[Step, ...] in order
    generation_finished = Signal(int, object)  # request_id, Summary
    generation_failed = Signal(int, str)  # request_id, one-line message
    sweep_requested = Signal(object)  # SweepJob (UI -> worker)
    sweep_progress = Signal(int, int, object)  # done, total, the RunRecord just measured
    sweep_finished = Signal(object)  # list[RunRecord]: every run measured (all of them, or up to a stop)
    sweep_failed = Signal(str)  # one-line message; the runs measured before it are lost
    train_requested = Signal(object)  # TrainRequest (UI -> worker)
    training_started = Signal(int)  # request_id
    training_progress = Signal(int, object)  # request_id, engine.types.TrainingProgress
    training_finished = Signal(int, object)  # request_id, summary dict (cancelled runs included)
    training_failed = Signal(int, str)  # request_id, one-line message
    head_attached = Signal(object)  # ModelInfo now in use, with the new draft head
    check_requested = Signal(object)  # app.ui.check.CheckJob (UI -> worker)
    check_progress = Signal(float, str)  # fraction done, what it is doing
    check_finished = Signal(object)  # engine.measure.check_types.CheckReport
    check_failed = Signal(str)  # one-line message

    def __init__(self, engine_factory: EngineFactory = default_engine_factory,
                 flush_interval_s: float = FLUSH_INTERVAL_S, room: RoomCheck | None = None,
                 head_trainer: HeadTrainer = default_head_trainer, release_on_cpu: bool | None = None) -> None:
        """release_on_cpu: let a CPU pair go before a new CPU pair loads even when both would fit
        (None: for real models). Nothing is lost: the app does not chat while loading, and a failed
        load brings the old pair back; kept, it doubles the peak (measured 1.94x one pair in bf16).
        """
        super().__init__()
        self._factory = engine_factory
        self._trainer = head_trainer
        self.train_cancel = threading.Event()  # set from the UI thread; checked between training steps
        self._flush_interval_s = flush_interval_s
        # Real models are measured; a custom factory (tests, the demo) holds what it holds.
        real = engine_factory is default_engine_factory
        self._room = room or (measure_room if real else _no_room_check)
        self._release_on_cpu = real if release_on_cpu is None else release_on_cpu
        self.engine: EngineLike | None = None
        self._engine_request: LoadSpec | None = None  # how the engine in use was loaded (to load it again)
        self.stop_event = threading.Event()  # set from the UI thread; checked between steps
        self.sweep_stop = threading.Event()  # set from the UI thread; checked between a sweep's runs
        self._cancel_upto = 0  # requests with an id <= this are cancelled (even before they start)
        self._closing = threading.Event()
        self.load_requested.connect(self._on_load_requested, Qt.ConnectionType.QueuedConnection)
        self.generate_requested.connect(self._on_generate_requested, Qt.ConnectionType.QueuedConnection)
        self.sweep_requested.connect(self._on_sweep_requested, Qt.ConnectionType.QueuedConnection)
        self.train_requested.connect(self._on_train_requested, Qt.ConnectionType.QueuedConnection)
        self.check_requested.connect(self._on_check_requested, Qt.ConnectionType.QueuedConnection)
        self.release_requested.connect(self._on_release_requested, Qt.ConnectionType.QueuedConnection)
        # Last, so its queued connections run after the worker's own: costs measured again when idle.
        self.costs = CostRefresh(self, (self.load_requested, self.generate_requested, self.sweep_requested,
                                        self.train_requested, self.check_requested), self._closing, parent=self)

    # --- called from the UI thread -------------------------------------------------------------

    def stop(self, request_id: int) -> None:
        """Cancels `request_id` and anything queued before it; safe from any thread."""
        self._cancel_upto = max(self._cancel_upto, request_id)
        self.stop_event.set()

    def stop_sweep(self) -> None:
        """Ends the sweep after its run in progress; safe from any thread."""
        self.sweep_stop.set()

    def cancel_training(self) -> None:
        """Stops a training at its next step; it still exports what it has (safe from any thread)."""
        self.train_cancel.set()

    def close(self) -> None:
        """Makes the current generation, training and any load stop at their next checkpoint."""
        self._closing.set()
        self.stop_event.set()
        self.sweep_stop.set()
        self.train_cancel.set()

    # --- slots (worker thread) -----------------------------------------------------------------

    @Slot(object)
    def _on_load_requested(self, request: LoadSpec) -> None:
        if self._closing.is_set():
            return
        self.load_started.emit(request)
        release_note = self._release_note(request)
        released = False

        def progress(p: Any) -> None:
            nonlocal released
            if self._closing.is_set():
                raise LoadCancelled()
            if release_note is not None and not released and getattr(p, "stage", None) in RELEASE_STAGES:
                # Checks passed; weights come next, and the old pair goes first (see _release_note).
                released = True
                self._release_engine(release_note)
            self.load_progress.emit(p)

        failure = None
        try:
            engine = self._factory(request, progress)  # new objects: the old engine stays unless released
        except LoadCancelled:
            log.info("model load cancelled because the app is closing")
            self.load_failed.emit("Loading was cancelled.")
            return
        except Exception as e:
            failure = load_error_message(e)
        if failure is not None:
            # Out of the except block: its traceback held the failed load's frames, and with them
            # whatever it had loaded, which must not stay beside the old pair loading again.
            if released:
                _release_memory()
                failure += self._load_previous_again(failure.rstrip("."))
            self.load_failed.emit(failure)
            if released and self.engine is not None:
                self.load_finished.emit(self.engine.info)
            return
        old, self.engine = self.engine, engine
        self._engine_request = request
        del old
        _release_memory()
        self.load_finished.emit(engine.info)

    def _release_note(self, request: LoadSpec) -> str | None:
        """What to say when the pair in use goes before the new one loads; None when it stays."""
        if self.engine is None:
            return None
        need, free = self._room(request, self.engine)
        if need is not None and free is not None and need > free:
            why = f"the new pair needs about {need / 1e9:.1f} GB and only {max(free, 0) / 1e9:.1f} GB is free beside it"
        elif self._release_on_cpu and _both_on_cpu(request, self.engine):
            why = "on the CPU one pair is held at a time, so loading takes the memory of one pair, not two"
        else:
            return None
        return f"Released the old pair to make room: {why}. It is loaded again if the new pair fails."

    def _release_engine(self, note: str) -> None:
        # The worker holds the only reference to the engine (the window keeps its tokenizer, which it
        # drops on engine_released): without it, the weights, runners, caches and head go here.
        self.engine = None
        _release_memory()
        log.info("%s", note)
        self.engine_released.emit(note)
        self.load_progress.emit(WorkerNotice("release", 0.0, note))

    def _load_previous_again(self, error: str) -> str:
        """After a failed load that released the pair in use: loads that pair again; says how it went."""
        previous = self._engine_request
        if previous is None:
            return ""
        self.load_progress.emit(WorkerNotice("reload", 0.0, f"The new pair failed ({error}); loading the old pair again"))

        def progress(p: Any) -> None:
            if self._closing.is_set():
                raise LoadCancelled()
            self.load_progress.emit(p)

        try:
            self.engine = self._factory(previous, progress)
        except LoadCancelled:
            self._engine_request = None
            return " The old pair was released to make room; loading it again was cancelled (the app is closing)."
        except Exception as e:
            log.warning("could not load the old pair again: %s", e)
            self._engine_request = None
            return (f" The old pair was released to make room and could not be loaded again ({first_line(e)}): "
                    "no models are loaded; choose File ▸ Load models….")
        log.info("the old pair, released to make room, was loaded again after the new pair failed")
        return " The old pair, released to make room, has been loaded again."

    @Slot(object)
    def _on_generate_requested(self, request: GenerationRequest) -> None:
        rid = request.request_id
        self.stop_event.clear()
        if rid <= self._cancel_upto or self._closing.is_set():
            self.stop_event.set()  # stopped while it waited in the queue
        self.generation_started.emit(rid)
        if self.engine is None:
            self.generation_failed.emit(rid, "No model is loaded yet; wait for loading to finish or load models.")
            return
        pending: list[Step] = []
        emitted: list[Step] = []
        last_flush = time.perf_counter()

        def flush() -> None:
            nonlocal last_flush
            if pending:
                batch = tuple(pending)
                pending.clear()
                emitted.extend(batch)
                self.steps.emit(rid, batch)
            last_flush = time.perf_counter()

        try:
            generation = self.engine.generate(request, self.stop_event,
                                              lambda progress: self.prefill_progress.emit(rid, progress))
            for step in generation:
                pending.append(step)
                if time.perf_counter() - last_flush >= self._flush_interval_s:
                    flush()
            flush()
            summary = generation.summary
            if summary is None:  # an engine that stopped early without summarising: derive it
                summary = summarize(emitted, mode=request.mode, k=request.k, prompt_tokens=0,
                                    seconds=emitted[-1].elapsed_s if emitted else 0.0,
                                    stop_reason="cancelled" if self.stop_event.is_set() else "eos")
        except Exception as e:
            flush()  # what was decoded before the error stays visible
            self.generation_failed.emit(rid, generation_error_message(e))
            return
        self.generation_finished.emit(rid, summary)

    @Slot(str)
    def _on_release_requested(self, note: str) -> None:
        if self.engine is not None:
            self._release_engine(note)

    @Slot(object)
    def _on_sweep_requested(self, job: Any) -> None:
        """Runs a sweep (engine.measure.sweep.run_sweep) on the resident engine; one terminal signal."""
        from engine.measure.sweep import run_sweep

        self.sweep_stop.clear()
        if self.engine is None:
            self.sweep_failed.emit("No model is loaded yet; wait for loading to finish or load models.")
            return
        try:
            records = run_sweep(self.engine, job.prompts, job.configs, make_request=job.make_request,  # type: ignore[arg-type]
                                max_new_tokens=job.max_new_tokens, repeat=job.repeat,
                                progress=lambda done, total, record: self.sweep_progress.emit(done, total, record),
                                cancel=self.sweep_stop)
        except Exception as e:
            self.sweep_failed.emit(generation_error_message(e))
            return
        self.sweep_finished.emit(records)

    @Slot(object)
    def _on_train_requested(self, request: TrainRequest) -> None:
        """Trains like a generation: on this thread, one terminal signal, cancelable between steps."""
        rid = request.request_id
        self.train_cancel.clear()
        if self._closing.is_set():
            self.train_cancel.set()
        self.training_started.emit(rid)
        if self.engine is None:
            self.training_failed.emit(rid, "No model is loaded yet; load the target first.")
            return
        try:
            summary, info = self._trainer(request, self.engine, lambda p: self.training_progress.emit(rid, p),
                                          self.train_cancel)
        except Exception as e:
            self.training_failed.emit(rid, training_error_message(e))
            return
        finally:
            _release_memory()  # the training's own copy of the target goes now
        if info is not None:
            self.head_attached.emit(info)
        self.training_finished.emit(rid, summary)

    @Slot(object)
    def _on_check_requested(self, job: Any) -> None:
        """The draft check on the resident engine; one terminal signal (check_finished or check_failed)."""
        job.run(self.engine, self.check_progress.emit, self.check_finished.emit, self.check_failed.emit, self._closing)


def _release_memory() -> None:
    # The replaced engine's weights go now, not at some later collection, so a new pair fits. The
    # collection itself runs on the GUI thread (app/ui/collector.py): a cycle may hold Qt objects.
    garbage.collect_garbage()
    memory = sys.modules.get("engine.models.memory")  # loaded with torch; not for a scripted engine
    if memory is not None:
        memory.trim_heap()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


class WorkerHost(QObject):
    """Starts the worker thread, owns it, and shuts it down without hanging or leaking it."""

    def __init__(self, engine_factory: EngineFactory = default_engine_factory,
                 parent: QObject | None = None, *, head_trainer: HeadTrainer = default_head_trainer) -> None:
        super().__init__(parent)
        self.worker = EngineWorker(engine_factory, head_trainer=head_trainer)
        self.thread = QThread()  # no parent: it must outlive nothing but this host
        self.thread.setObjectName("EngineWorker")
        self.worker.moveToThread(self.thread)
        self.thread.finished.connect(self.worker.costs.timer.stop, Qt.ConnectionType.DirectConnection)  # its thread
        _threads.add(self.thread)
        # While the thread lives, cycles are collected on the GUI thread only (app/ui/collector.py).
        self._collector = collector()
        self._collector.acquire()
        self._holds_collector = True
        self.thread.start()

    def shutdown(self, timeout_s: float = SHUTDOWN_WAIT_S) -> bool:
        """Stops generation, cancels loading at its next stage, quits the thread; True if it ended."""
        if not self.thread.isRunning():
            self._release_collector()
            return True
        self.worker.close()
        self.thread.quit()
        if self._wait(timeout_s):
            return True
        # A single from_pretrained call cannot be interrupted; the cancel lands at the next stage.
        log.warning("the engine is still busy (loading weights?); waiting for it to reach a stopping point")
        if self._wait(6 * timeout_s):
            return True
        log.error("the engine thread did not stop; leaving it to the operating system")
        _orphans.append(self)  # destroying a running QThread aborts the process; keep it referenced
        return False

    def _wait(self, timeout_s: float) -> bool:
        # The worker must not wait for this thread to collect garbage while this thread waits for it.
        with self._collector.blocked():
            ended = self.thread.wait(int(timeout_s * 1000))
        if ended:
            self._release_collector()
        return ended

    def _release_collector(self) -> None:
        if self._holds_collector:
            self._holds_collector = False
            self._collector.release()
