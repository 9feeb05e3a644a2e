"""Reloading models in the app: on the CPU, or when two pairs do not fit, the old one goes first (and comes back on failure)."""
from __future__ import annotations

import shutil
import time
import weakref
from dataclasses import dataclass, replace

import pytest
import torch

from app.core.demo import DEMO_INFO
from engine.loadspec import LoadSpec
from app.ui.worker import EngineWorker
from engine.errors import ModelLoadError
from engine.models import memory


@dataclass
class Stage:
    stage: str
    fraction: float
    message: str


class Factory:
    """Scripted loads: reports check then load stages, records whether the old engine was gone by then."""

    def __init__(self, worker_ref: list[EngineWorker], fail: dict[str, str] | None = None) -> None:
        self.worker_ref = worker_ref
        self.fail = fail or {}  # target name -> stage at which loading it fails
        self.engine_at_load: list[object] = []  # the worker's engine when each load reached its weights
        self.calls: list[str] = []

    def __call__(self, request: LoadSpec, progress):
        name = request.target or "default"
        self.calls.append(name)
        progress(Stage("check", 0.0, "Checking tokenizers"))
        if self.fail.get(name) == "check":
            raise ModelLoadError(f"{name}: different tokenizers")
        progress(Stage("load", 0.0, "Loading weights"))
        self.engine_at_load.append(self.worker_ref[0].engine)
        if self.fail.get(name) == "load":
            raise ModelLoadError(f"{name}: out of memory loading weights")
        return type("E", (), {"info": replace(DEMO_INFO, target_name=name), "generate": None})()


@pytest.fixture
def make_worker(qapp):
    def make(fits: bool, fail: dict[str, str] | None = None, *, release_on_cpu: bool = False, device: str = "cpu"):
        ref: list[EngineWorker] = []
        factory = Factory(ref, fail)
        worker = EngineWorker(factory, room=lambda _req, _engine: (10, 100 if fits else 5),
                              release_on_cpu=release_on_cpu)
        ref.append(worker)
        events: list[tuple[str, object]] = []
        worker.load_finished.connect(lambda info: events.append(("finished", info.target_name)))
        worker.load_failed.connect(lambda m: events.append(("failed", m)))
        worker.engine_released.connect(lambda m: events.append(("released", m)))
        worker.load_progress.connect(lambda p: events.append((p.stage, p.message)) if p.stage in ("release", "reload")
                                     else None)
        worker._on_load_requested(LoadSpec(target="first", device=device))
        events.clear()
        return worker, factory, events

    return make


def test_pairs_that_fit_together_keep_the_old_one_until_the_new_is_ready(make_worker):
    worker, factory, events = make_worker(fits=True)
    old = worker.engine
    worker._on_load_requested(LoadSpec(target="second"))
    assert factory.engine_at_load[-1] is old  # still answering while the new weights load
    assert events == [("finished", "second")] and worker.engine.info.target_name == "second"


def test_pairs_that_do_not_fit_release_the_old_one_first_and_say_so(make_worker):
    worker, factory, events = make_worker(fits=False)
    worker._on_load_requested(LoadSpec(target="second"))
    assert factory.engine_at_load[-1] is None  # released before the new weights came in
    (kind, note), status, finished = events
    assert kind == "released" and note.startswith("Released the old pair to make room: the new pair needs about")
    assert status == ("release", note)  # the status bar says it too
    assert finished == ("finished", "second")


def test_a_failed_load_after_release_loads_the_old_pair_again(make_worker):
    worker, factory, events = make_worker(fits=False, fail={"second": "load"})
    worker._on_load_requested(LoadSpec(target="second"))
    kinds = [k for k, _ in events]
    assert kinds == ["released", "release", "reload", "failed", "finished"]
    assert "loading the old pair again" in events[2][1]
    assert "out of memory" in events[3][1] and "has been loaded again" in events[3][1]
    assert events[4] == ("finished", "first") and worker.engine.info.target_name == "first"
    assert factory.calls == ["first", "second", "first"]


def test_a_failure_before_the_weights_keeps_the_old_pair(make_worker):
    worker, factory, events = make_worker(fits=False, fail={"second": "check"})
    old = worker.engine
    worker._on_load_requested(LoadSpec(target="second"))
    assert events == [("failed", "second: different tokenizers")] and worker.engine is old


def test_when_the_old_pair_cannot_come_back_either(make_worker):
    worker, factory, events = make_worker(fits=False, fail={"second": "load"})
    factory.fail["first"] = "load"
    worker._on_load_requested(LoadSpec(target="second"))
    assert [k for k, _ in events] == ["released", "release", "reload", "failed"]
    assert "could not be loaded again" in events[3][1] and "no models are loaded" in events[3][1]
    assert worker.engine is None


def test_on_the_cpu_the_old_pair_goes_first_although_both_fit(make_worker):
    worker, factory, events = make_worker(fits=True, release_on_cpu=True)
    worker._on_load_requested(LoadSpec(target="second", device="cpu"))
    assert factory.engine_at_load[-1] is None
    (kind, note), _status, finished = events
    assert kind == "released" and note.startswith("Released the old pair to make room: on the CPU")
    assert finished == ("finished", "second")


def test_on_the_cpu_a_failed_load_brings_the_old_pair_back(make_worker):
    worker, factory, events = make_worker(fits=True, fail={"second": "load"}, release_on_cpu=True)
    worker._on_load_requested(LoadSpec(target="second", device="cpu"))
    assert [k for k, _ in events] == ["released", "release", "reload", "failed", "finished"]
    assert worker.engine.info.target_name == "first" and factory.calls == ["first", "second", "first"]


def test_a_pair_off_the_cpu_stays_while_the_next_loads_when_both_fit(make_worker):
    worker, factory, events = make_worker(fits=True, release_on_cpu=True)
    worker.engine = type("E", (), {"info": replace(DEMO_INFO, device="cuda:0"), "generate": None})()
    old = worker.engine
    worker._on_load_requested(LoadSpec(target="second", device="cpu"))
    assert factory.engine_at_load[-1] is old and events == [("finished", "second")]


def test_window_shows_the_release_and_disables_send(qtbot, tmp_path):
    from app.ui.settings import AppSettings
    from app.ui.window import MainWindow
    from engine.settings import ModelSelection

    w = MainWindow(engine_factory=lambda _r, _p: type("E", (), {"info": DEMO_INFO})(),
                   settings=AppSettings(tmp_path / "s.ini"))
    qtbot.addWidget(w)
    with qtbot.waitSignal(w.models_loaded, timeout=5000):
        w.load_models(ModelSelection())
    assert w.info is not None
    with qtbot.waitSignal(w.worker.engine_released, timeout=5000):
        w.worker.engine_released.emit("Releasing the current models first: test")
    qtbot.waitUntil(lambda: w.info is None)
    assert not w.prompt.button.isEnabled() and w.send("hi") is None
    notes = []
    w.chat.add_system_note = notes.append  # what the window says in the chat from now on
    w.worker.engine_released.emit("Releasing the current models first: again")
    qtbot.waitUntil(lambda: bool(notes))
    assert notes == ["Releasing the current models first: again"]
    w.close()


def test_pair_bytes_from_headers(tiny_pair):
    size = memory.pair_bytes(str(tiny_pair[0]), str(tiny_pair[1]), with_draft=True, device="cpu", dtype="float32")
    from transformers import AutoModelForCausalLM

    params = sum(sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(f)).parameters()) for f in tiny_pair)
    assert size == params * 4  # a tied head is stored, and counted, once
    half = memory.pair_bytes(str(tiny_pair[0]), None, with_draft=False, device="cpu", dtype="bfloat16")
    assert half == memory.folder_bytes(tiny_pair[0], torch.bfloat16)


def test_measure_room_compares_the_headers_with_free_memory(tiny_pair, monkeypatch):
    from app.ui.worker import measure_room

    request = LoadSpec(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), device="cpu", dtype="float32")
    monkeypatch.setattr(memory, "available_bytes", lambda: 64 << 30)
    monkeypatch.setattr(memory, "total_bytes", lambda: 64 << 30)
    need, free = measure_room(request, object())
    assert need == memory.pair_bytes(request.target, request.draft, with_draft=True, device="cpu", dtype="float32")
    assert free == (64 << 30) - (16 << 30)  # a quarter of the machine stays free
    monkeypatch.setattr(memory, "available_bytes", lambda: need)  # exactly the new pair: not with the margin
    need, free = measure_room(request, object())
    assert free < need


# --------------------------------------------------------------------------- the app, with tiny real models

def _at_weights(monkeypatch, check) -> None:
    """Runs check() on the worker thread when each load reaches its weights, after the worker's own progress."""
    from engine import assemble

    real = assemble.build_engine

    def spying(spec, progress):
        first = [True]

        def spy(p):
            progress(p)  # the worker's: where it releases the old pair
            if p.stage == "load" and first[0]:
                first[0] = False
                check()

        return real(spec, spy)

    monkeypatch.setattr(assemble, "build_engine", spying)


def _tiny_window(qtbot, tmp_path, tiny_pair):
    from app.ui.settings import AppSettings
    from app.ui.window import MainWindow
    from engine.settings import ModelChoice, ModelSelection

    w = MainWindow(settings=AppSettings(tmp_path / "s.ini"))  # the real engine factory and release policy
    qtbot.addWidget(w)
    selection = ModelSelection(target=ModelChoice("folder", str(tiny_pair[0])),
                               draft=ModelChoice("folder", str(tiny_pair[1])), device="cpu", dtype="float32")
    with qtbot.waitSignal(w.models_loaded, timeout=60000):
        w.load_models(selection)
    notes: list[str] = []
    shown = w.chat.add_system_note
    w.chat.add_system_note = lambda text: (notes.append(text), shown(text))
    return w, selection, notes


def _references(engine) -> dict[str, weakref.ref]:
    """Weak references to what holds memory in a loaded pair (the window also holds its tokenizer)."""
    return {name: weakref.ref(obj) for name, obj in (("engine", engine), ("target", engine.target),
                                                     ("draft", engine.draft), ("tokenizer", engine.tokenizer))}


def test_app_reload_on_the_cpu_frees_the_old_pair_before_the_new_weights(qtbot, tmp_path, tiny_pair, monkeypatch,
                                                                          no_dangling_threads):
    w, selection, notes = _tiny_window(qtbot, tmp_path, tiny_pair)
    old = _references(w.worker.engine)
    alive_at_weights: list[list[str]] = []

    def check():  # the window drops its tokenizer on engine_released, on the UI thread: give it a moment
        deadline = time.monotonic() + 5
        while any(r() is not None for r in old.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        alive_at_weights.append([name for name, r in old.items() if r() is not None])

    _at_weights(monkeypatch, check)
    status: list[str] = []
    w.worker.load_progress.connect(lambda p: status.append(p.message) if p.stage == "release" else None)
    with qtbot.waitSignal(w.models_loaded, timeout=60000):
        w.load_models(selection)
    assert alive_at_weights == [[]], f"still alive while the new pair loaded: {alive_at_weights}"
    released = [n for n in notes if n.startswith("Released the old pair to make room: on the CPU")]
    assert len(released) == 1 and status == released  # said in the chat and in the status bar
    assert w.info is not None and w.info.target_name == "target"
    w.close()


def test_app_reload_that_fails_after_the_release_brings_the_old_pair_back(qtbot, tmp_path, tiny_pair, dialogs,
                                                                           no_dangling_threads):
    from engine.settings import ModelChoice

    w, selection, notes = _tiny_window(qtbot, tmp_path, tiny_pair)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_pair[0], broken)
    weights = broken / "model.safetensors"
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    with open(weights, "r+b") as f:
        f.truncate(header + 16)  # headers intact (checks and plan pass), weights cut short: fails loading them
    with qtbot.waitSignal(w.models_loaded, timeout=60000):
        w.load_models(replace(selection, target=ModelChoice("folder", str(broken))))
    assert any(n.startswith("Released the old pair to make room") for n in notes)
    assert [title for _, title, _ in dialogs] == ["Could not load the models"]
    assert "has been loaded again" in dialogs[0][2]
    assert w.info is not None and w.info.target_name == "target" and w.worker.engine is not None
    assert w.selection == selection  # the failed choice is not remembered
    assert notes[-1].startswith("Loaded target + draft")
    w.close()
