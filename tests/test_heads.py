"""Draft heads: training improves them, what is trained is what runs, shards are checked, heads fit one target."""
from __future__ import annotations

import json
import shutil
import threading
from dataclasses import replace

import pytest
import torch

from engine.errors import IncompatibleModelsError, ModelLoadError
from engine.heads import data as D
from engine.heads.config import feature_layers, fingerprint
from engine.heads.distill import DistillError, plan_with
from engine.heads.runner import HeadRunner
from engine.heads.shards import SHARD_BYTES, head_for, load_head, open_head, read_manifest
from engine.heads.train import Teacher, unrolled_states
from tests.head_fixtures import TINY_PLAN, distiller, load_target, quick_plan

TINY_SEED = TINY_PLAN.seed  # the seed the tiny head's own run used


def _log(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "train_log.jsonl").read_text(encoding="utf-8").splitlines()]


def test_training_lowers_the_loss_and_raises_acceptance(tiny_head):
    log = _log(tiny_head.head)
    train = [r for r in log if r["kind"] == "train"]
    evals = [r for r in log if r["kind"] == "eval"]
    assert train[-1]["loss"] < 0.8 * train[0]["loss"], (train[0]["loss"], train[-1]["loss"])
    assert train[-1]["acc"][0] > train[0]["acc"][0] + 0.2
    before, after = evals[0]["acceptance"], evals[-1]["acceptance"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 150
    assert after[0] > before[0] + 0.25, (before, after)  # the first draft token: chance level -> about half
    assert tiny_head.summary["finished"] and tiny_head.summary["held_out_acceptance"] == after


@pytest.mark.parametrize("layers", [1, 2])
def test_the_trained_maths_is_the_decoding_maths(tiny_head, request, layers):
    """Unrolled training states (teacher-forced tokens) == the runner's catch-up and chain steps, for a head of
    one decoder layer and of two (each layer's keys and values in training as in its own cache)."""
    folder = tiny_head.head if layers == 1 else request.getfixturevalue("tiny_two_layer_head")
    target, _ = load_target(tiny_head.target)
    head = load_head(read_manifest(folder), torch.device("cpu"), torch.float32).bind(target)
    assert head.config.layers == layers
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (1, 40), generator=g)
    teacher = Teacher(target, head.config.feature_layers)
    features, _ = teacher(ids, torch.tensor([40]))
    teacher.close()
    cos, sin = head.rope_tables(64, torch.device("cpu"), torch.float32)
    states = list(unrolled_states(head, features, ids, 4, cos, sin))
    runner = HeadRunner(head, max_length=128, k_max=8)
    m = 25
    runner.catch_up(features[0, :m], ids[0, 1 : m + 1], 128)
    for s in range(4):
        if s:
            runner.token.copy_(ids[0, m + s : m + s + 1])  # teacher forcing, as in training
            runner.step(128)
        torch.testing.assert_close(runner.last_logits, head.logits(states[s][0, m - 1]).float(), atol=1e-4, rtol=1e-4)


def test_a_grown_head_drafts_exactly_what_it_grew_from(tiny_head):
    """Layers added to a trained head start as the identity: the same states in training, the same drafts."""
    target, _ = load_target(tiny_head.target)
    one = load_head(read_manifest(tiny_head.head), torch.device("cpu"), torch.float32).bind(target)
    three = one.grown(3).bind(target)
    assert three.config.layers == 3 and len(three.more) == 2 and three.config == replace(one.config, layers=3)
    assert three.num_trained() > one.num_trained()
    ids = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(1))
    teacher = Teacher(target, one.config.feature_layers)
    features, _ = teacher(ids, torch.tensor([30, 30]))
    teacher.close()
    cos, sin = one.rope_tables(48, torch.device("cpu"), torch.float32)
    for a, b in zip(unrolled_states(one, features, ids, 4, cos, sin), unrolled_states(three, features, ids, 4, cos, sin)):
        assert torch.equal(a, b)
    drafts = []
    for head in (one, three):
        runner = HeadRunner(head, max_length=128, k_max=6)
        runner.catch_up(features[0, :20], ids[0, 1:21], 128)
        for _ in range(5):
            runner.step(128)
        drafts.append(runner.drafts.clone())
    assert torch.equal(*drafts)


def test_the_verify_pass_leaves_the_features_training_reads(tiny_head):
    from engine.runners import EagerRunner

    target, _ = load_target(tiny_head.target)
    layers = feature_layers(target.config.num_hidden_layers)
    ids = torch.arange(5, 25)
    runner = EagerRunner(target)
    runner.keep_hidden(layers)
    runner.prefill(ids[:12])
    prefilled = runner.hidden
    runner.forward(ids[12:])
    teacher = Teacher(target, layers)
    features, _ = teacher(ids[None], torch.tensor([20]))
    teacher.close()
    torch.testing.assert_close(torch.cat([prefilled, runner.hidden]), features[0])


def test_shards_are_small_and_checked_by_sha256(tiny_head, tmp_path):
    files = read_manifest(tiny_head.head)
    assert all(s["bytes"] <= SHARD_BYTES for s in files.manifest["shards"])
    copy = tmp_path / "head"
    shutil.copytree(tiny_head.head, copy)
    shard = copy / files.manifest["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="damaged"):
        load_head(read_manifest(copy), torch.device("cpu"), torch.float32)


def test_a_head_for_another_target_is_refused(tiny_head, tiny_pair):
    other, _ = load_target(tiny_pair[0])
    with pytest.raises(IncompatibleModelsError, match="layer count"):
        open_head(tiny_head.head, other)
    assert head_for(other, [tiny_head.head]) is None
    same, _ = load_target(tiny_head.target)
    assert head_for(same, [tiny_head.head]) is not None


def test_a_fine_tune_of_the_same_shape_is_refused(tiny_head):
    target, _ = load_target(tiny_head.target)
    with torch.no_grad():
        target.model.norm.weight.mul_(1.5)  # another fine-tune: same config, other weights
    with pytest.raises(IncompatibleModelsError, match="another model of the same shape"):
        open_head(tiny_head.head, target)


def test_fingerprint_ignores_dtype_and_version_fields(tiny_head):
    a, _ = load_target(tiny_head.target, torch.float32)
    b, _ = load_target(tiny_head.target, torch.bfloat16)
    b.config.transformers_version = "0.0.0"
    fa, fb = fingerprint(a), fingerprint(b)
    assert fa.config_sha256 == fb.config_sha256
    open_head(tiny_head.head, b)  # bf16 rounding of the probe is tolerated


def test_benchmark_and_test_prompts_are_refused():
    refusals = D.Refusals(D.packaged_refusals())
    bench = [json.loads(line)["prompt"] for line in open("assets/bench_prompts.jsonl", encoding="utf-8")]
    edit = [json.loads(line)["prompt"] for line in open("assets/edit_prompts.jsonl", encoding="utf-8")]
    for prompt in bench + edit:
        assert refusals.match(prompt) is not None
        assert refusals.match("  " + prompt.upper() + " Please answer briefly.") is not None
    assert refusals.match("用一句话解释什么是快速排序") is not None  # the real-pair test's prompt, punctuation aside
    assert refusals.match("Write a haiku about autumn leaves falling in Kyoto.") is None
    assert refusals.match("How do I reverse a linked list in C?") is None


def test_distill_refuses_given_benchmark_prompts(tiny_head, tmp_path):
    with pytest.raises(DistillError, match="Refusing"):
        distiller(tiny_head.target, tmp_path / "out", tmp_path / "work",
                  extra_questions=["What is the capital of Australia?"])


def test_magpie_prefix_ends_where_the_user_writes(tiny_head):
    _, tok = load_target(tiny_head.target)
    prefix = D.user_turn_prefix(tok, "Users ask about code.")
    assert prefix.endswith("<|im_start|>user\n") and "Users ask about code." in prefix


def test_distillation_resumes_where_it_stopped(tiny_head, tmp_path):
    """Cancelled mid-training, run again: data rounds are not redone and training continues to its end."""
    plan = quick_plan(max_rounds=2, max_steps=30, checkpoint_every_s=0.0)
    cancel = threading.Event()
    seen = []

    def progress(p):
        if p.record and p.record.get("kind") == "train":
            seen.append(p.record["step"])
            if p.record["step"] >= 10:
                cancel.set()

    first = distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", plan, progress=progress,
                      cancel=cancel).run()
    assert not first["finished"] and 10 <= first["steps"] < 30
    assert (tmp_path / "out" / "manifest.json").exists()  # every call leaves a usable head
    second = distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", plan).run()
    assert second["finished"] and second["steps"] == 30 and second["data_rounds"] == 2 and second["calls"] == 2
    log = _log(tmp_path / "work")
    assert [r["round"] for r in log if r["kind"] == "data"] == [1, 2]
    steps = [r["step"] for r in log if r["kind"] == "train"]
    assert steps == sorted(steps) and steps[-1] == 30
    with pytest.raises(DistillError, match="other settings"):
        distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", quick_plan(max_rounds=3)).run()


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [1, 2])
def test_head_graphs_draft_what_the_eager_head_drafts(tiny_head, request, layers):
    """On CUDA: the captured catch-up and chain steps reproduce the eager ones (same buffers, positions), for a
    head of one decoder layer and of two."""
    folder = tiny_head.head if layers == 1 else request.getfixturevalue("tiny_two_layer_head")
    target, _ = load_target(tiny_head.target)
    target = target.to("cuda")
    head = load_head(read_manifest(folder), torch.device("cuda"), torch.float32).bind(target)
    graphs = HeadRunner(head, max_length=1024, k_max=6)
    graphs.warmup()
    assert graphs.graphs, "no graph was captured"
    eager = HeadRunner(head, max_length=1024, k_max=6, use_graphs=False)
    g = torch.Generator().manual_seed(1)
    features = torch.randn(40, head.config.features, generator=g).cuda()
    ids = torch.randint(0, 300, (40,), generator=g).cuda()
    for runner in (graphs, eager):
        runner.reset()
        runner.catch_up(features[:30], ids[:30], runner.span(40))
        for width in (3, 1, 5):  # verify widths after a round: graphs for each
            start = runner.length
            runner.catch_up(features[start : start + width], ids[start : start + width], runner.span(60))
            for _ in range(4):
                runner.step(runner.span(60))
    torch.cuda.synchronize()
    assert graphs.length == eager.length == 39
    assert torch.equal(graphs.drafts[:5], eager.drafts[:5])
    torch.testing.assert_close(graphs.last_logits, eager.last_logits)
    torch.testing.assert_close(graphs.k_cache[:, :, :43], eager.k_cache[:, :, :43])
    for (k_graphs, _), (k_eager, _) in zip(graphs.more_kv, eager.more_kv, strict=True):
        torch.testing.assert_close(k_graphs[:, :, :43], k_eager[:, :, :43])


def test_a_head_continues_from_a_finished_run(tiny_head, tmp_path):
    """--init: the run starts from the head's weights and vocabulary on fresh data; its log and budget carry over."""
    before = read_manifest(tiny_head.head)
    plan = quick_plan(max_rounds=2, max_steps=20, seed=5)
    summary = distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", plan, init=before).run()
    log = _log(tmp_path / "work")
    first = next(r for r in log if r["kind"] == "eval")
    assert first["step"] == 0 and first["acceptance"][0] > 0.3, first  # not a fresh head: chance is far below
    vocab = next(r for r in log if r["kind"] == "vocab")
    assert vocab["from"] == "tiny head" and vocab["size"] == before.config.draft_vocab
    after = read_manifest(tmp_path / "out")
    assert after.config == before.config
    assert torch.equal(load_head(after, torch.device("cpu"), torch.float32).d2t,
                       load_head(before, torch.device("cpu"), torch.float32).d2t)
    used = tiny_head.summary["used_minutes"]
    assert summary["continued_from"] == {"name": "tiny head", "used_minutes": used}
    assert summary["used_minutes_in_all"] == pytest.approx(used + summary["used_minutes"], abs=0.011)
    shipped_log = _log(tmp_path / "out")
    kinds = [r["kind"] for r in shipped_log]
    assert kinds.index("continue") == len(_log(tiny_head.head)), "the earlier run's log, the marker, then this one"
    assert kinds[-1] == "eval"  # the final evaluation (the export record follows the copy, in the work log)
    with pytest.raises(DistillError, match="another head"):
        distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", plan).run()


def test_a_continued_run_writes_fresh_questions_with_the_same_seed(tiny_head, tmp_path):
    """--init with the seed the head was trained with: the data is new (seeded by the head it continues),
    so a run continued twice never trains twice on the same answers; a resumed call writes the same data."""
    from engine.heads.fitting import load_round

    def questions(work) -> set[str]:
        return {r["question"] for r in load_round(work / "data" / "round-00000.pt")}

    before = read_manifest(tiny_head.head)
    plan = quick_plan(max_rounds=2, max_steps=2, seed=TINY_SEED)
    distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", plan, init=before).run()
    fresh = questions(tmp_path / "work")
    assert fresh and fresh.isdisjoint(questions(tiny_head.work))
    data = next(r for r in _log(tmp_path / "work") if r["kind"] == "data")
    assert data["seed"] != TINY_SEED  # the log says which seed wrote the round
    distiller(tiny_head.target, tmp_path / "out2", tmp_path / "work2", plan, init=before).run()
    assert questions(tmp_path / "work2") == fresh  # reproducible from the seed and the head


def test_a_run_trains_on_the_data_of_an_earlier_run_again(tiny_head, tmp_path):
    """--data: an earlier run's rounds are trained on beside the fresh ones; the fresh questions avoid theirs,
    only fresh answers are held out, and the log repeats their records so a head that saw them says so."""
    from app.core.head_log import read_log
    from engine.heads.fitting import load_round

    kept = [r for path in sorted((tiny_head.work / "data").glob("round-*.pt")) for r in load_round(path)]
    before = read_manifest(tiny_head.head)
    plan = quick_plan(max_rounds=1, max_steps=4, seed=5)
    run = distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", plan, init=before,
                    data=[tiny_head.work / "data"])  # the data folder names its work folder
    summary = run.run()
    fresh = load_round(tmp_path / "work" / "data" / "round-00000.pt")
    assert {r["question"] for r in fresh}.isdisjoint(r["question"] for r in kept)
    train, held = run._sequences()
    assert summary["kept_rounds"] == 4 and summary["sequences"] == len(train) == len(fresh) - len(held) + len(kept)
    fresh_ids = {tuple(r["ids"].tolist()) for r in fresh if r["greedy"]}
    assert held and all(tuple(s.ids.tolist()) in fresh_ids for s in held)
    logged = [r for r in _log(tmp_path / "work") if r.get("kept_from")]
    earlier = [r for r in _log(tiny_head.work) if r["kind"] == "data"]
    assert [{k: v for k, v in r.items() if k not in ("time_s", "kept_from")} for r in logged] == \
        [{k: v for k, v in r.items() if k != "time_s"} for r in earlier]
    records, runs = read_log(tmp_path / "out" / "train_log.jsonl")
    marker = next(r for r in records if r["kind"] == "continue")
    assert runs == 2 and marker["repeat"] and marker["fresh"]  # the head saw those rounds in its first run
    assert [bool(r.get("repeat")) for r in records if r["kind"] == "data"][len(earlier):] == [True] * 4 + [False]

    with pytest.raises(DistillError, match="other --data folders"):  # resumed without them
        distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", plan, init=before).run()
    with pytest.raises(DistillError, match="own work folder"):
        distiller(tiny_head.target, tmp_path / "o", tmp_path / "work", plan, data=[tmp_path / "work"])
    foreign = tmp_path / "foreign"
    shutil.copytree(tiny_head.work / "data", foreign / "data")
    state = json.loads((tiny_head.work / "state.json").read_text(encoding="utf-8"))
    state["fingerprint"]["hidden"] += 1
    (foreign / "state.json").write_text(json.dumps(state), encoding="utf-8")
    with pytest.raises(DistillError, match="another target"):
        distiller(tiny_head.target, tmp_path / "o", tmp_path / "w2", plan, data=[foreign])


def test_a_continued_run_grows_the_head_a_layer(tiny_head, tmp_path):
    """--plan layers=2 with --init: the continued head gets a second layer that starts as the identity (its first
    evaluation is the one-layer head's), trains it, and ships it; fewer layers than the head has are refused."""
    before = read_manifest(tiny_head.head)
    firsts = {}
    for layers in (0, 2):
        plan = quick_plan(max_rounds=1, max_steps=6, seed=5, layers=layers)
        distiller(tiny_head.target, tmp_path / f"out{layers}", tmp_path / f"work{layers}", plan, init=before).run()
        firsts[layers] = next(r for r in _log(tmp_path / f"work{layers}") if r["kind"] == "eval")["acceptance"]
    assert firsts[2] == pytest.approx(firsts[0], abs=1e-6)  # the same held-out answers, the same drafts
    after = read_manifest(tmp_path / "out2")
    assert after.config == replace(before.config, layers=2) and read_manifest(tmp_path / "out0").config == before.config
    grown = load_head(after, torch.device("cpu"), torch.float32)
    assert grown.more[0].wo.abs().max() > 0  # trained away from the identity
    with pytest.raises(DistillError, match="keeps them"):
        distiller(tiny_head.target, tmp_path / "o", tmp_path / "w", quick_plan(layers=1), init=after)
    with pytest.raises(ValueError, match="layers"):
        plan_with(TINY_PLAN, {"layers": "9"})


def test_a_kept_folders_damaged_log_lines_are_not_copied(tiny_head, tmp_path):
    """--data copies a kept round's own log record; a line that is not one (bad JSON, a count that is not a
    count) gives way to what the round file itself holds."""
    from engine.heads.fitting import load_round
    from engine.heads.reuse import find_kept

    kept = tmp_path / "kept"
    shutil.copytree(tiny_head.work, kept)
    lines = []
    for record in _log(kept):
        if record["kind"] == "data" and record["round"] == 2:
            record = {**record, "answer_tokens": "many"}  # round 2's own line, damaged
        lines.append(json.dumps(record))
    lines += ["not json", '{"kind": "data", "round": true, "answer_tokens": 5}',  # `true` is no round
              "[" * 100_000 + "]" * 100_000]  # nested past what the JSON reader recurses through
    (kept / "train_log.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    logged = find_kept(kept).logged
    assert sorted(logged) == [1, 3, 4]
    distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", quick_plan(max_rounds=1, max_steps=1),
              data=[kept]).run()  # the kept run's own seed: the kept rounds move the data seed, so questions are new
    second = next(r for r in _log(tmp_path / "work") if r.get("kept_from") and r["round"] == 2)
    records = load_round(kept / "data" / "round-00001.pt")
    assert second["answer_tokens"] == sum(len(x["ids"]) - x["prompt_len"] for x in records)


def test_a_call_that_ends_during_the_data_leaves_the_rest_of_the_data_to_the_next_call(tiny_head, tmp_path):
    """The data's share of the budget is written in full: a call cut short by its own limit does not start
    training on the rounds it has; the next call writes the rest, then trains."""
    plan = quick_plan(max_rounds=3, max_steps=2)
    first = distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", plan)
    # After the first round the call has a little more than its reserve left: not enough for another round.
    first.clock.call_left = lambda: float("inf") if first.state["rounds"] == 0 else plan.reserve_s + 1e-3
    first.run()
    state = json.loads((tmp_path / "work" / "state.json").read_text(encoding="utf-8"))
    assert (state["phase"], state["rounds"], state["step"]) == ("data", 1, 0)
    summary = distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", plan).run()
    assert summary["data_rounds"] == 3 and summary["steps"] == 2


def test_plan_settings_change_by_name_and_are_checked():
    from engine.heads.distill import DistillPlan, plan_with

    plan = plan_with(DistillPlan(), {"answer_segment": "128", "data_share": "0.6", "train.lr": "3e-4",
                                     "questions_must_end": "false"})
    assert (plan.answer_segment, plan.data_share, plan.train.lr, plan.questions_must_end) == (128, 0.6, 3e-4, False)
    for bad, match in [({"answer_segmnet": "1"}, "unknown plan setting 'answer_segmnet'"),
                       ({"train.depht": "4"}, "known: train.batch_tokens"),
                       ({"question_batch": "many"}, "expected int"), ({"minutes": "3"}, "unknown"),
                       ({"data_share": "nan"}, "from 0 to 1"), ({"data_share": "1.5"}, "from 0 to 1"),
                       ({"question_batch": "0"}, "from 1 to 16384"), ({"train.lr": "inf"}, "from 0 to 1")]:
        with pytest.raises(ValueError, match=match):
            plan_with(DistillPlan(), bad)


def test_answers_in_segments_equal_answers_in_one_call(tiny_head):
    """Greedy: continuing the rows that did not end, segment by segment, writes what one long generate writes."""
    model, tok = load_target(tiny_head.target)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 14, 7)]
    whole = D.sample_segmented(model, tok, prompts, max_new=20, segment=0, temperature=0.0, top_p=1.0, seed=0)
    parts = D.sample_segmented(model, tok, prompts, max_new=20, segment=6, temperature=0.0, top_p=1.0, seed=0)
    assert parts == whole
    assert all(len(ids) == 20 or ended for ids, ended in parts)


def test_data_rounds_hold_second_turns_written_after_the_first_answer(tiny_head):
    """A follow-up's prompt is the whole conversation: the first question and the target's own first answer,
    then the follow-up question the target wrote as the user."""
    from engine.heads.fitting import load_round

    _, tok = load_target(tiny_head.target)
    records = [r for path in sorted((tiny_head.work / "data").glob("round-*.pt")) for r in load_round(path)]
    firsts = {r["question"]: r for r in records if r["turns"] == 1}
    seconds = [r for r in records if r["turns"] == 2]
    assert seconds and all(r["prompt_len"] < r["ids"].numel() for r in seconds)
    prompt = tok.decode(seconds[0]["ids"][: seconds[0]["prompt_len"]].tolist())
    assert seconds[0]["question"] in prompt
    first = prompt.index(seconds[0]["question"])
    assert any(0 <= prompt.find(q) < first for q in firsts)  # an earlier question leads the conversation


def test_data_falls_back_to_generate_when_the_batched_writer_gives_non_finite_logits(tiny_head, tmp_path, monkeypatch):
    """The continuous writer's NaN is one logged line; the round is written by Hugging Face's generate."""
    from engine.heads.generate import ContinuousSampler, NonFiniteLogits

    def broken(self, *args, **kwargs):
        raise NonFiniteLogits("The batched forward gave logits that are not finite.")

    monkeypatch.setattr(ContinuousSampler, "run", broken)
    d = distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", plan=quick_plan(max_rounds=1, max_steps=2))
    d.run()
    log = [json.loads(line) for line in (tmp_path / "work" / "train_log.jsonl").read_text().splitlines()]
    assert [r["writer"] for r in log if r["kind"] == "writer"] == ["generate"]
    (data,) = [r for r in log if r["kind"] == "data"]
    assert data["writer"] == "generate" and data["answers"] > 0


def test_a_folder_that_holds_no_head_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    import engine.heads.distill as distill

    monkeypatch.setattr(distill, "load_pair", lambda *a, **k: pytest.fail("the target loaded before the check"))
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "manifest.json").write_bytes(b"\xaa\x00 not json")
    for folder in (tmp_path / "missing", tmp_path / "garbage"):
        with pytest.raises(DistillError, match=f"^Cannot continue from {folder}: .*not a draft head folder"):
            distill.prepare(None, tmp_path / "out", minutes=1.0, init=folder)


def test_a_new_run_never_replaces_a_head_it_did_not_make(tiny_head, tmp_path, monkeypatch):
    """A head folder given as --out (or the dialog's folder) whose head this run did not start: the export would
    delete its shards and rewrite its manifest, so the run is refused before the target loads, in one line. A run
    continuing in its own folder (its work folder's state there) goes on."""
    import engine.heads.distill as distill
    from app.cli import main

    theirs = tmp_path / "theirs"
    shutil.copytree(tiny_head.head, theirs)
    before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    monkeypatch.setattr(distill, "load_pair", lambda *a, **k: pytest.fail("the target loaded before the check"))
    for init in (None, theirs):  # a new head, or continuing that very head into its own folder
        with pytest.raises(DistillError, match=f"^{theirs} already holds a draft head"):
            distill.prepare(None, theirs, minutes=1.0, init=init)
    assert main(["distill", "--out", str(theirs), "--minutes", "1"]) == 2
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before  # nothing written, nothing removed
    distill.check_out(tiny_head.head, tiny_head.work)  # the fixture's own run: its work folder holds its state
