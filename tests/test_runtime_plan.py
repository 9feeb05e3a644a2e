"""The Models dialog plans what will run (the GGUFs and context of llama.cpp, the converted weights of torch), and
"Train a draft head…" on llama.cpp offers the switch to torch with what it costs."""
from __future__ import annotations

from dataclasses import replace

import pytest

from app.core.demo import DEMO_INFO, ScriptedEngine
from app.core.session import plan_for
from app.ui.settings import AppSettings
from app.ui.window import MainWindow
from engine.errors import ModelLoadError
from engine.runners.llamacpp import unavailable_reason
from engine.settings import ModelSelection
from widgets.model_dialog import ModelDialog


def _packaged_facts():
    from engine.runners.llamacpp_plan import gguf_facts

    if unavailable_reason() is not None:
        pytest.skip(f"llama.cpp is not installed: {unavailable_reason()}")
    try:
        return gguf_facts(None, "target"), gguf_facts(None, "draft")
    except ModelLoadError as e:
        pytest.skip(f"the packaged pair is not installed: {e}")


def test_the_llamacpp_plan_names_the_ggufs_and_their_real_context():
    target, draft = _packaged_facts()
    plan = plan_for(ModelSelection(runtime="llamacpp"))
    assert plan.runner == "llama.cpp"
    assert plan.target_precision == f"{target.file_type} GGUF" == "Q4_K_M GGUF"
    assert plan.draft_precision == f"{draft.file_type} GGUF"
    assert plan.context == min(32768, target.max_positions) == 32768  # the runner's default, the model allows it
    weights = {i.model: i.bytes for i in plan.devices[0].items if i.kind == "weights"}
    assert weights == {"target": target.size, "draft": draft.size}  # the files as they are, not bf16
    # A shorter context plans (and loads) a shorter cache: the KV lines scale with it.
    short = plan_for(ModelSelection(runtime="llamacpp", context=4096))
    kv = lambda p: sum(i.bytes for i in p.devices[0].items if i.kind == "kv")  # noqa: E731
    assert short.context == 4096 and kv(plan) == pytest.approx(8 * kv(short), rel=1e-6)
    # auto on this CPU runs llama.cpp, so the plan is the same; torch plans the converted weights.
    assert plan_for(ModelSelection()).target_precision == "Q4_K_M GGUF"
    on_torch = plan_for(ModelSelection(runtime="torch"))
    assert on_torch.runner != "llama.cpp" and "GGUF" not in on_torch.target_precision


def test_the_models_dialog_shows_the_plan_of_the_runtime_chosen(qtbot):
    _packaged_facts()
    dialog = ModelDialog(ModelSelection(runtime="llamacpp"), planner=plan_for)
    qtbot.addWidget(dialog)
    text = dialog.plan_bar.summary.text()
    assert "llama.cpp" in text and "Q4_K_M GGUF" in text and "32,768" in text and "bfloat16" not in text
    assert dialog.context.specialValueText() == "auto (32,768)"
    dialog.runtime.setCurrentIndex(dialog.runtime.findData("torch"))
    dialog.update_plan()
    assert "GGUF" not in dialog.plan_bar.summary.text() and dialog.context.specialValueText() == "auto (8,192)"


@pytest.fixture
def llamacpp_window(qtbot, tmp_path, no_dangling_threads):
    """A window whose scripted engine reports the runtime it was asked for (auto: llama.cpp, as on this CPU)."""
    loads = []

    def factory(spec, _progress):
        loads.append(spec)
        runtime = "torch" if spec.runtime == "torch" else "llamacpp"
        return ScriptedEngine(delay_s=0.0, info=replace(DEMO_INFO, runtime=runtime, target_ms=((1, 50.0), (2, 90.0)),
                                                        fast_path="llama.cpp" if runtime == "llamacpp" else "eager"))

    w = MainWindow(engine_factory=factory, settings=AppSettings(tmp_path / "s.ini"))
    qtbot.addWidget(w)
    w.show()
    with qtbot.waitSignal(w.models_loaded, timeout=10000):
        w.load_models(ModelSelection())
    yield w, loads
    w.close()


def test_train_head_on_llamacpp_offers_torch_and_switching_loads_it(qtbot, llamacpp_window):
    _packaged_facts()
    w, loads = llamacpp_window
    asked: list[str] = []
    w.loading.ask_switch = lambda text: asked.append(text) or False  # keep llama.cpp
    assert w.open_train_dialog() is None and len(asked) == 1
    assert w.selection.runtime == "auto" and len(loads) == 1  # nothing reloaded
    text = asked[0]
    assert "20.0 target forwards a second" in text  # 1000 / the 50 ms measured at load
    assert "Q4_K_M GGUF" in text and "GiB" in text and "slower" in text

    w.loading.ask_switch = lambda text: True
    with qtbot.waitSignal(w.models_loaded, timeout=10000):
        assert w.open_train_dialog() is None
    assert loads[-1].runtime == "torch" and w.selection.runtime == "torch" and w.info.runtime == "torch"
    assert AppSettings(w.settings.file_name()).models().runtime == "torch"  # remembered like any load
    assert w.training.dialog is not None and w.training.dialog.isVisible()  # the head's dialog opened itself
    w.training.dialog.close()
