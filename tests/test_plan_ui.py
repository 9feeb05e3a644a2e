"""The memory plan where people meet it: the Models dialog's bar and suggestion, asking before a load, the CLI."""
from __future__ import annotations

import json

import pytest

from app.cli import main as cli_main
from app.core.session import device_line, load_request_for, plan_for
from engine.settings import ModelChoice, ModelSelection
from engine.types import DevicePlan, MemoryPlan, ModelInfo, PlanChange, PlanItem
from widgets.model_dialog import ModelDialog

GiB = 2**30


def _plan(total_gib: float, capacity_gib: float, suggestion: PlanChange | None = None) -> MemoryPlan:
    items = (PlanItem("weights", "target", "target weights (bfloat16)", int((total_gib - 1) * GiB)),
             PlanItem("runtime", "", "runtime", GiB))
    device = DevicePlan("cuda:0", items, int(capacity_gib * GiB), "given")
    return MemoryPlan("T", "D", "bfloat16", "bfloat16", 8192, "cuda-graphs", (device,), suggestion)


CHANGE = PlanChange(description="Quantize the target to nf4 and shorten the context to 4,096 tokens",
                    target_precision="nf4", draft_precision="bfloat16", context=4096, draft=None, with_draft=True,
                    draft_name=None, needed=20 * GiB)


def test_dialog_shows_a_plan_that_does_not_fit_and_applies_the_suggestion(qtbot):
    asked: list[ModelSelection] = []

    def planner(selection: ModelSelection) -> MemoryPlan:
        asked.append(selection)
        fits = selection.target_precision == "nf4"
        return _plan(20 if fits else 66, 24, None if fits else CHANGE)

    dialog = ModelDialog(ModelSelection(device="cuda"), planner=planner)
    qtbot.addWidget(dialog)
    bar = dialog.plan_bar
    assert not dialog.plan.fits and "Does not fit" in bar.verdict.text()
    assert "Quantize the target to nf4" in bar.suggestion.text() and not bar.apply.isHidden()
    bar.apply.click()  # the suggestion becomes the dialog's choice, and the plan follows
    chosen = dialog.selection()
    assert (chosen.target_precision, chosen.context) == ("nf4", 4096)
    assert dialog.plan.fits and "Fits" in bar.verdict.text() and bar.apply.isHidden()
    assert asked[-1].target_precision == "nf4"


def test_dialog_replans_after_a_change_and_says_why_it_cannot(qtbot):
    from engine.errors import ModelLoadError

    def planner(selection: ModelSelection) -> MemoryPlan:
        if selection.target.kind == "hub":
            raise ModelLoadError("someone/model is not in the local Hugging Face cache and there is no network")
        return _plan(5, 24)

    dialog = ModelDialog(ModelSelection(), planner=planner)
    qtbot.addWidget(dialog)
    assert dialog.plan.fits
    dialog.target.hub.setText("someone/model")
    dialog.target.hub.textEdited.emit("someone/model")
    qtbot.waitUntil(lambda: dialog.plan is None, timeout=2000)  # re-planned once typing paused
    assert "no network" in dialog.plan_bar.verdict.text()


def test_dialog_offers_presets_and_round_trips_the_new_fields(qtbot):
    from engine.models.presets import pair_presets

    presets = pair_presets()
    selection = ModelSelection(target_precision="int8", draft_precision="nf4", context=4096, memory_gib=24.0,
                               device="cuda")
    dialog = ModelDialog(selection, planner=plan_for, presets=presets)
    qtbot.addWidget(dialog)
    assert dialog.selection() == selection
    index = 1 + [p.name for p in presets].index("qwen2.5-32b")
    dialog.preset.setCurrentIndex(index)
    dialog.preset.activated.emit(index)
    chosen = dialog.selection()
    assert chosen.target == ModelChoice("hub", "Qwen/Qwen2.5-32B-Instruct")
    assert chosen.draft == ModelChoice("hub", "Qwen/Qwen2.5-0.5B-Instruct")
    assert dialog.plan is not None and dialog.plan.target_name == "Qwen/Qwen2.5-32B-Instruct"


def test_selection_to_load_request_carries_precision_context_memory_and_force():
    sel = ModelSelection(target_precision="nf4", draft_precision="int8", context=2048, memory_gib=24.0)
    r = load_request_for(sel, force=True)
    assert (r.target_precision, r.draft_precision, r.context, r.memory, r.force) == ("nf4", "int8", 2048, 24 * GiB, True)
    r = load_request_for(ModelSelection())
    assert (r.target_precision, r.context, r.memory, r.force) == ("auto", None, None, False)
    bad = ModelSelection.from_dict({"target_precision": "int3", "context": -4, "memory_gib": float("nan")})
    assert (bad.target_precision, bad.context, bad.memory_gib) == ("auto", 0, 0.0)


def test_status_bar_says_which_model_runs_without_graphs():
    info = ModelInfo("T", "D", "cuda:0", "bfloat16", "static-eager", 100, target_precision="int8",
                     draft_precision="bfloat16", fast_path_note="target: int8 layers (bitsandbytes) cannot be captured")
    assert device_line(info) == "cuda:0 · target int8, draft bfloat16 · static-eager (no CUDA graphs for the target)"
    split = ModelInfo("T", None, "cuda:1", "bfloat16", "cuda-graphs", 100, devices=("cuda:0", "cuda:1"))
    assert device_line(split) == "cuda:0 + cuda:1 · bfloat16 · cuda-graphs"


def test_window_asks_before_loading_what_will_not_fit(monkeypatch, qtbot):
    from PySide6.QtWidgets import QMessageBox

    from app.ui import loading
    from app.ui.notices import Notices

    requests = []

    class FakeDialog:
        DialogCode = ModelDialog.DialogCode

        def __init__(self, *a, **k):
            self.plan = _plan(66, 24, CHANGE)

        def exec(self):
            return ModelDialog.DialogCode.Accepted

        def selection(self):
            return ModelSelection(device="cuda")

    monkeypatch.setattr(loading, "ModelDialog", FakeDialog)
    notices = Notices(None, None)  # only the question is asked here
    for answer, expected in ((QMessageBox.StandardButton.No, []), (QMessageBox.StandardButton.Yes, [True])):
        monkeypatch.setattr(QMessageBox, "question", lambda *a, answer=answer, **k: requests.append(a) or answer)
        choice = loading.choose_models(ModelSelection(), notices, attach_check=lambda dialog: None)  # no "Check drafts"
        loaded = [choice] if choice is not None else []
        assert [force for _, force in loaded] == expected
    assert "Quantize the target to nf4" in requests[-1][2] and "66.0 GiB" in requests[-1][2]


def test_cli_plan_prints_the_plan_offline_and_exits_1_when_it_does_not_fit(capsys):
    code = cli_main(["plan", "--preset", "qwen3-32b", "--device", "cuda", "--memory", "24GiB"])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT" in out and "Cheapest change that fits" in out
    code = cli_main(["plan", "--preset", "qwen3-32b", "--device", "cuda", "--memory", "80GiB", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["fits"] and plan["devices"][0]["capacity"] == 80 * GiB
    code = cli_main(["plan", "--preset", "qwen3-32b", "--device", "cuda", "--memory", "24GiB", "--target-quant", "nf4",
                     "--draft-quant", "nf4", "--context", "2048"])
    assert code == 0 and "(nf4)" in capsys.readouterr().out


def test_cli_plan_presets_table(capsys):
    assert cli_main(["plan", "--presets"]) == 0
    out = capsys.readouterr().out
    names = ("default", "r1-distill-14b", "qwen2.5-14b", "qwen2.5-32b", "qwen3-32b", "qwen3-32b-0.6b", "llama3.1-8b")
    for name in names:
        assert f"\n{name} " in out
    assert "24 GiB" in out and "80 GiB" in out


def test_cli_fails_with_the_plan_before_loading(tiny_pair, capsys, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded although the plan said no"))
    code = cli_main(["generate", "--prompt", "hi", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
                     "--device", "cpu", "--memory", "1MiB"])
    err = capsys.readouterr().err
    assert code == 2 and "DOES NOT FIT" in err and "it will not fit" in err and "--force" in err
    assert err.strip().splitlines()[-1].startswith("specdec-studio: error:")


def test_cli_rejects_preset_with_target():
    assert cli_main(["plan", "--preset", "default", "--target", "x/y"]) == 2


def test_a_hub_preset_without_network_says_so_plainly(monkeypatch):
    """HF_HUB_OFFLINE is set for tests: a preset's hub id that is not cached cannot be fetched."""
    from engine.errors import ModelLoadError
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    with pytest.raises(ModelLoadError) as e:
        load_pair(LoadSpec("Qwen/Qwen3-32B", "Qwen/Qwen3-0.6B", device="cpu"))
    message = str(e.value)
    assert "\n" not in message and "no network" in message and "packaged default pair" in message


def test_a_preset_in_the_local_hub_cache_loads(tiny_pair, tmp_path, monkeypatch):
    """A preset's hub id that is in the local cache loads from there (here the cache is a fake snapshot)."""
    import huggingface_hub

    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    folders = {"Qwen/Qwen2.5-0.5B-Instruct": tiny_pair[1], "Qwen/Qwen2.5-14B-Instruct": tiny_pair[0]}
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **k: str(folders[repo_id]))
    pair = load_pair(LoadSpec("Qwen/Qwen2.5-14B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", device="cpu", dtype="float32"))
    assert pair.info.target_name == "Qwen/Qwen2.5-14B-Instruct" and pair.plan.fits
