"""Shared fixtures: tiny random model pairs on disk (built once per session)."""
from __future__ import annotations

import os

import pytest

import engine  # noqa: F401  (before torch: OpenMP's passive wait, engine/cpu_threads.py)

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Conversations of windows a test builds without a store go to a throw-away folder, never the user's.
if "SPECDEC_DATA_DIR" not in os.environ:
    import tempfile

    os.environ["SPECDEC_DATA_DIR"] = tempfile.mkdtemp(prefix="specdec-test-data-")


def pytest_configure(config):
    import torch

    # Tiny models are dominated by per-op overhead; a second thread only adds contention.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir): a 2-layer Qwen2 target and a noisy copy as its draft."""
    from tests.tiny import save_pair

    return save_pair(tmp_path_factory.mktemp("tiny"), noise=0.02, seed=0)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _qt_garbage_goes_on_the_gui_thread(request):
    """After a test with Qt objects, their cycles are collected here, on the GUI thread: left for later,
    a collection on another thread (a pool's, a worker's) would destroy them there, which crashes Qt
    (app/ui/collector.py guards the app's own worker; this covers the widgets' pools between tests)."""
    yield
    if "qtbot" in request.fixturenames:
        import gc

        gc.collect()


@pytest.fixture(autouse=True)
def _no_modal_dialog_waits_for_a_person(monkeypatch):
    """A modal dialog a test did not expect fails that test at once, naming the dialog: nobody answers it under
    CI, and a modal loop holds the Python thread where the timeout's alarm cannot end it. A test that expects
    one replaces the call itself (the `dialogs` fixture, or monkeypatch)."""
    try:
        from PySide6.QtWidgets import QDialog, QFileDialog, QInputDialog, QMessageBox
    except ImportError:  # a machine without Qt (the GPU machine) runs the engine's tests only
        return

    def refuse(name):
        def opened(*args, **kwargs):
            texts = [a for a in args if isinstance(a, str)] or [getattr(args[0], "windowTitle", lambda: "")()]
            raise AssertionError(f"a modal dialog would wait for a person: {name}{tuple(texts)!r}")
        return opened

    for cls, names in ((QMessageBox, ("critical", "warning", "information", "question", "about", "exec")),
                       (QDialog, ("exec",)),
                       (QFileDialog, ("getSaveFileName", "getOpenFileName", "getExistingDirectory")),
                       (QInputDialog, ("getText", "getItem", "getInt"))):
        for name in names:
            monkeypatch.setattr(cls, name, refuse(f"{cls.__name__}.{name}"))


@pytest.fixture
def dialogs(monkeypatch) -> list[tuple[str, str, str]]:
    """Records QMessageBox calls instead of blocking on a modal dialog."""
    from PySide6.QtWidgets import QMessageBox

    calls: list[tuple[str, str, str]] = []

    def record(kind):
        def show(_parent, title, text, *args, **kwargs):
            calls.append((kind, title, text))
            return QMessageBox.StandardButton.Ok
        return show

    for kind in ("critical", "warning", "information"):
        monkeypatch.setattr(QMessageBox, kind, record(kind))
    return calls


@pytest.fixture
def no_dangling_threads():
    """Fails a test that leaves a worker QThread running (napari's fixture does the same)."""
    import gc

    from app.ui.worker import running_threads

    yield
    assert not running_threads(), f"dangling worker threads: {running_threads()}"
    assert gc.isenabled(), "a worker host was not shut down: garbage is still collected on the GUI thread only"


@pytest.fixture(scope="session")
def tiny_head(tmp_path_factory):
    """A predictable tiny target and a draft head distilled from it (about half its drafts accepted)."""
    from tests.head_fixtures import build_tiny_head

    return build_tiny_head(tmp_path_factory.mktemp("head"))


@pytest.fixture(scope="session")
def tiny_two_layer_head(tiny_head, tmp_path_factory):
    """The tiny head grown to two decoder layers, the second with random output projections (it changes the
    drafts): a head folder beside the tiny target."""
    from tests.head_fixtures import two_layer_head

    return two_layer_head(tiny_head, tmp_path_factory.mktemp("head2") / "head")
