"""The Qt-free session: settings → request (the one conversion), the chat's turns and requests, verdicts."""
from __future__ import annotations

from app.core.session import ChatSession, build_request, cost_verdict, load_request_for, system_messages
from engine.measure.stats import summarize
from engine.settings import GenerationSettings, ModelChoice, ModelSelection
from engine.types import Message, ModelInfo, Step, TokenView

INFO = ModelInfo(target_name="t", draft_name="d", device="cpu", dtype="float32", fast_path="eager", vocab_size=10,
                 draft_ms=10.0, target_ms=((1, 30.0), (2, 32.0), (3, 34.0), (4, 36.0), (5, 38.0), (6, 40.0)))


def _step(index: int, accepted: int, proposed: int, text: str = "x") -> Step:
    token = TokenView(token_id=1, text=text, status="accepted", step=index, draft_pos=0, q=0.5, p=0.5,
                      accept_prob=1.0)
    return Step(index=index, mode="speculative", proposed=(1,) * proposed, proposed_q=(0.5,) * proposed,
                proposed_p=(0.5,) * proposed, sources=("draft",) * proposed, accepted=accepted, added=2,
                added_status="corrected", tokens=(token,), text=text, new_tokens=accepted + 1,
                total_tokens=0, draft_ms=1.0, verify_ms=1.0, elapsed_s=0.1)


def _summary(steps, k=5):
    return summarize(steps, mode="speculative", k=k, prompt_tokens=3, seconds=1.0, stop_reason="eos")


def test_build_request_is_the_one_conversion():
    s = GenerationSettings(mode="speculative", proposer="draft+ngram", k=7, temperature=0.7, top_k=40, top_p=0.9,
                           seed=3, max_new_tokens=99, system_prompt="  Be brief.  ")
    messages = system_messages(s) + (Message("user", "hi"),)
    r = build_request(s, messages, 12)
    assert r.messages == (Message("system", "Be brief."), Message("user", "hi"))
    assert (r.mode, r.proposer, r.k, r.max_new_tokens, r.request_id) == ("speculative", "draft+ngram", 7, 99, 12)
    assert (r.sampling.temperature, r.sampling.top_k, r.sampling.top_p, r.sampling.seed) == (0.7, 40, 0.9, 3)
    raw = build_request(s, (), prompt="text")
    assert raw.messages == () and raw.prompt == "text"
    assert system_messages(GenerationSettings(system_prompt="   ")) == ()


def test_load_request_for_a_selection():
    sel = ModelSelection(target=ModelChoice("folder", " /m/t "), draft=ModelChoice(), device="cpu", dtype="float32")
    r = load_request_for(sel)
    assert (r.target, r.draft, r.device, r.dtype, r.with_draft) == ("/m/t", None, "cpu", "float32", True)
    assert load_request_for(ModelSelection(no_draft=True, draft=ModelChoice("hub", "a/b"))).draft is None
    assert (r.runtime, r.threads) == ("auto", None)  # threads None: the physical cores
    r = load_request_for(ModelSelection(runtime="llamacpp", threads=3))
    assert (r.runtime, r.threads) == ("llamacpp", 3)


def test_runtime_label_names_the_runtime_and_why():
    from dataclasses import replace

    from app.core.session import runtime_label

    llama = replace(INFO, fast_path="llama.cpp", runtime="llamacpp", threads=2, dtype="Q4_K_M")
    assert runtime_label(llama) == "llama.cpp · 2 threads"
    assert runtime_label(replace(llama, threads=3, threads_batch=4)) == "llama.cpp · 3 threads (4 for prompts)"
    assert runtime_label(replace(INFO, fast_path="cpu-onednn", threads=1)) == "cpu-onednn · 1 thread"
    assert runtime_label(INFO) == "eager"
    fallback = replace(INFO, fast_path="cpu-onednn", runtime_note="llama.cpp unavailable (ImportError: x)")
    assert runtime_label(fallback) == "cpu-onednn (torch; llama.cpp unavailable (ImportError: x))"


def test_chat_turns_requests_and_records():
    session = ChatSession()
    session.info = INFO
    settings = GenerationSettings(system_prompt="sys", k=3)
    first = session.send("hello", settings)
    assert session.active_request == first.request_id and session.owns(first.request_id)
    assert first.messages == (Message("system", "sys"), Message("user", "hello"))
    assert session.add_steps(first.request_id, (_step(0, 2, 3, "Hi"),))
    assert not session.add_steps(999, (_step(0, 2, 3),))  # the race's request ids are not the chat's
    record = session.finish(first.request_id, _summary([_step(0, 2, 3, "Hi")], k=3))
    assert record is not None and len(record.steps) == 1 and record.info == INFO
    assert session.active_request is None and not session.owns(first.request_id)
    assert session.history == [Message("user", "hello"), Message("assistant", "Hi")]
    # Regenerate asks the last user turn again; the old answer stays as another version (a branch).
    first_answer = session.conversation.path()[-1].id
    again, replaced = session.regenerate(settings)
    assert replaced == first_answer and again.request_id != first.request_id
    assert again.messages[-1] == Message("user", "hello") and session.history == [Message("user", "hello")]
    assert len(session.conversation.siblings(first_answer)) == 2
    assert session.fail(again.request_id) and not session.fail(again.request_id)
    assert session.records == [record]


def test_new_chat_detaches_the_streaming_answer():
    session = ChatSession()
    r = session.send("one", GenerationSettings())
    assert session.new_chat() == r.request_id
    session.finish(r.request_id, _summary([_step(0, 1, 2, "late")]))
    assert session.history == []  # the late answer belongs to the old chat
    assert len(session.records) == 1  # but is still exported
    assert session.regenerate(GenerationSettings()) is None


def test_ids_never_repeat_between_chat_and_race():
    session = ChatSession()
    ids = {session.allocate_request_id() for _ in range(5)} | {session.send("x", GenerationSettings()).request_id}
    assert len(ids) == 6


def test_cost_verdict_before_and_after_an_answer():
    assert cost_verdict(None, None) == ("", "")
    short, full = cost_verdict(INFO, None)
    assert short == "The draft costs 33% of a forward" and "10.0 ms" in full
    summary = _summary([_step(i, 5, 5) for i in range(9)] + [_step(9, 0, 5)])
    short, full = cost_verdict(INFO, summary)
    assert short.startswith("Speculative decoding pays here: about ") and "the draft costs 33% of a forward" in short
    assert full.startswith("Predicted ") and "at K=5" in full and "pays here" in full
    # A draft head's cost per token replaces the draft model's when the head proposed.
    from dataclasses import replace

    assert cost_verdict(INFO, None, "head") == ("", "")  # no head measured
    short, full = cost_verdict(replace(INFO, head_ms=1.5), None, "head")
    assert short.startswith("The draft head costs ") and "draft head 1.5 ms per token" in full
    # N-gram lookup at its own measured cost, named as what drafted.
    from engine.types import ProposerCost

    ngram = replace(INFO, proposer_costs=(ProposerCost("ngram", 0.004, 0.01),))
    short, full = cost_verdict(ngram, summary, "ngram")
    assert "n-gram lookup 0.004 ms per token" in full and "the n-gram lookup costs 0%" in full


def test_a_summary_names_the_proposer_that_drafted_most():
    from dataclasses import replace

    steps = [replace(_step(i, 3, 4), sources=("head",) * 4) for i in range(3)] + [replace(_step(3, 1, 2),
                                                                                          sources=("ngram",) * 2)]
    assert _summary(steps).drafter == "head"
    assert _summary([]).drafter is None


def test_settings_are_validated_and_clamped():
    s = GenerationSettings.from_dict({"seed": 3_000_000_000, "k": 400, "temperature": float("nan"),
                                      "top_p": "x", "mode": "weird", "max_new_tokens": -5, "top_k": 2.5})
    assert s.seed == 2**31 - 1 and s.k == 12 and s.temperature == 0.0 and s.top_p == 1.0
    assert s.mode == "auto" and s.max_new_tokens == 1 and s.top_k == 0  # the default mode: auto
    assert GenerationSettings.from_dict({"k": -3}).k == 0  # K auto is the lowest K
    assert GenerationSettings.from_dict({"seed": float("inf")}).seed == 0
    sel = ModelSelection.from_dict({"target": {"kind": "nonsense", "value": 3}, "draft": "x", "device": "tpu",
                                    "dtype": 7, "no_draft": "yes"})
    assert sel == ModelSelection(no_draft=True)
    assert ModelSelection.from_dict({"device": "cuda:1"}).device == "cuda:1"
    assert ModelSelection.from_dict({"runtime": "tpu", "threads": -4}) == ModelSelection()
    assert ModelSelection.from_dict({"runtime": "llamacpp", "threads": "2"}) == ModelSelection(runtime="llamacpp",
                                                                                               threads=2)
    assert ModelChoice.from_spec("x.gguf") == ModelChoice("gguf", "x.gguf")
    assert ModelChoice.from_spec("Qwen/Qwen2.5-0.5B") == ModelChoice("hub", "Qwen/Qwen2.5-0.5B")
    assert ModelChoice.from_spec(" default ") == ModelChoice()
