"""Tokens accepted through a branch of a draft tree: their mark in every token view, their hover, the legend, the
tree plot, and the wire, CSV and stored forms that carry them (hand-made Steps and the scripted engine; no torch)."""
from __future__ import annotations

import csv
import json
import threading
from dataclasses import replace

import numpy as np
import pytest
from PySide6.QtGui import QTextCharFormat, QTextCursor

from app.core.chat_tree import StoredTokens
from app.core.demo import DEMO_ANSWER, ScriptedEngine, scripted_steps
from app.core.export import ENCODING, TRACE_COLUMNS, AnswerRecord, write_trace_csv
from app.core.remote import RemotePiece, _tree, _views
from app.core.remote_answer import RemoteAnswer
from app.serve import protocol as wire
from engine.measure.stats import summarize
from engine.types import GenerationRequest, Step, TokenView
from widgets.palette import THEMES, load_palette

DOTTED = QTextCharFormat.UnderlineStyle.DotLine
FIRST = "drafted as the head's first choice after the previous token"
SECOND = "drafted as the head's 2nd choice after the previous token (a branch of the tree)"


def tree_step(index: int, accepted: list[tuple[str, int]], rejected: str | None, added: str, *, total_before: int = 0,
              width: int = 64, depth: int = 5) -> Step:
    """A head's tree round: accepted (text, branch rank) along the walked path, the head's first choice where the
    walk stopped (rejected), then the target's token."""
    tokens = [TokenView(10 * index + i, text, "accepted", index, i, 0.8 if rank == 0 else 0.2, 0.9, 1.0, "head", rank)
              for i, (text, rank) in enumerate(accepted)]
    if rejected is not None:
        tokens.append(TokenView(10 * index + 8, rejected, "rejected", index, len(accepted), 0.6, 0.1, 0.1, "head", 0))
    status = "corrected" if rejected is not None else "bonus"
    tokens.append(TokenView(10 * index + 9, added, status, index, None, None, 0.7, None, None))
    n = len(accepted) + (rejected is not None)
    return Step(index=index, mode="speculative", proposed=tuple(t.token_id for t in tokens[:n]),
                proposed_q=(0.5,) * n, proposed_p=(0.5,) * n, sources=("head",) * n, accepted=len(accepted),
                added=tokens[-1].token_id, added_status=status, tokens=tuple(tokens),  # type: ignore[arg-type]
                text="".join(t for t, _ in accepted) + added, new_tokens=len(accepted) + 1,
                total_tokens=total_before + len(accepted) + 1, draft_ms=1.0, verify_ms=4.0,
                elapsed_s=(index + 1) * 0.005, tree_width=width, tree_depth=depth)


def chain_step(index: int, text: str, total_before: int) -> Step:
    token = TokenView(100 + index, text, "accepted", index, 0, 0.8, 0.9, 1.0, "draft")
    added = TokenView(200 + index, "!", "bonus", index, None, None, 0.7, None, None)
    return Step(index=index, mode="speculative", proposed=(token.token_id,), proposed_q=(0.8,), proposed_p=(0.9,),
                sources=("draft",), accepted=1, added=added.token_id, added_status="bonus", tokens=(token, added),
                text=text + "!", new_tokens=2, total_tokens=total_before + 2, draft_ms=1.0, verify_ms=4.0,
                elapsed_s=(index + 1) * 0.005)


def steps() -> list[Step]:
    """'Hello world of trees.' (" world" and " trees" through branches), then a chain step ' ok!'."""
    return [tree_step(0, [("Hello", 0), (" world", 1)], " there", " of"),
            tree_step(1, [(" trees", 2)], None, ".", total_before=3, width=40, depth=1),
            chain_step(2, " ok", total_before=5)]


def marked(view) -> list[tuple[str, bool]]:
    """(text, dotted underline) of every shown token."""
    out = []
    for start, end, _status in view.token_spans():
        cursor = QTextCursor(view.document())
        cursor.setPosition(start + 1)
        out.append((view.document().toPlainText()[start:end], cursor.charFormat().underlineStyle() == DOTTED))
    return out


# --- the mark and the hover ---------------------------------------------------------------------------


@pytest.fixture
def token_view(qtbot):
    from widgets.token_text import TokenTextView

    view = TokenTextView()
    qtbot.addWidget(view)
    view.resize(500, 300)
    return view


def test_the_mark_is_on_exactly_the_tokens_a_branch_brought(token_view):
    token_view.append_steps(steps())
    shown = marked(token_view)
    assert [t for t, m in shown if m] == [" world", " trees"]
    assert len(shown) == 7  # Hello, world, of, trees, ., ok, ! (the rejected draft is a mark, not text)
    colours = load_palette("light").colours("accepted")
    cursor = QTextCursor(token_view.document())
    cursor.setPosition(len("Hello") + 2)
    fmt = cursor.charFormat()
    assert fmt.underlineColor() == colours.foreground  # the token's own text colour: its contrast
    assert fmt.background().color() == colours.background  # still the accepted colour: no new status
    token_view.set_show_rejected(False)  # a re-render keeps the marks
    assert [t for t, m in marked(token_view) if m] == [" world", " trees"]
    token_view.set_colouring(False)  # plain reading mode shows no statuses, so no marks either
    assert not any(m for _, m in marked(token_view))


def test_the_hover_says_which_of_the_heads_choices_a_token_was(token_view):
    from widgets.token_text import format_token_tooltip

    token_view.append_steps(steps())
    world = token_view.token_at(len("Hello") + 1)
    hello = token_view.token_at(0)
    ok = token_view.token_at(len("Hello world of trees.") + 1)
    assert token_view.tooltip_at(len("Hello") + 1).endswith("\n" + SECOND)
    assert token_view.tooltip_at(0).endswith("\n" + FIRST)
    assert "\n" not in token_view.tooltip_at(len("Hello world of trees.") + 1) and ok.branch is None  # a chain
    assert "choice" not in format_token_tooltip(token_view.token_at(len("Hello world")))  # the target's own token
    third = replace(world, branch=2, source="draft")
    assert format_token_tooltip(third).endswith("the draft model's 3rd choice after the previous token "
                                                "(a branch of the tree)")
    assert hello.branch == 0
    # The rejected draft where the walk stopped: the head's first choice there.
    assert FIRST in token_view.mark_tooltip(0)


def test_ordinals():
    from widgets.tree_marks import ordinal

    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == \
        ["1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th"]


def test_chat_bubbles_and_race_panes_mark_branches_too(qtbot):
    from widgets.chat.view import ChatView
    from widgets.race.view import RaceView

    chat = ChatView()
    qtbot.addWidget(chat)
    chat.begin_assistant_message(3, "")
    chat.append_steps(3, steps())
    assert [t for t, m in marked(chat.token_view(3)) if m] == [" world", " trees"]
    race = RaceView()
    qtbot.addWidget(race)
    race.start_pane("speculative")
    race.append_steps("speculative", steps())
    assert [t for t, m in marked(race.panes["speculative"].view) if m] == [" world", " trees"]


@pytest.mark.parametrize("theme", THEMES)
def test_the_legend_explains_the_mark_at_aa_contrast(qtbot, theme):
    from tests.test_chat_render import contrast
    from widgets.legend import Legend
    from widgets.palette import current_theme, set_current_theme

    before = current_theme()
    set_current_theme(theme)
    try:
        legend = Legend()
        qtbot.addWidget(legend)
        chip = legend.branch_chip()
        assert "dotted underline" in chip.toolTip() and "hover" in chip.toolTip()
        accepted = load_palette(theme).colours("accepted")
        assert chip._underline == accepted.foreground
        assert contrast(accepted.foreground, accepted.background) >= 4.5
        legend.set_visible_statuses(["target"])
        assert chip.isHidden()
        legend.set_visible_statuses(["accepted", "target"])
        assert not chip.isHidden()
    finally:
        set_current_theme(before)


# --- the tree plot ---------------------------------------------------------------------------------------


def test_the_charts_plot_tree_width_and_depth_only_for_answers_with_tree_rounds(qtbot):
    from widgets.charts import LiveCharts

    charts = LiveCharts()
    qtbot.addWidget(charts)
    tree = charts.plots()["tree"]
    assert tree.scene() is None  # no answer yet: no room for it
    charts.push_steps(steps())
    charts.refresh()
    s = charts.series()
    np.testing.assert_array_equal(s["tree_width"][:2], [64, 40])
    np.testing.assert_array_equal(s["tree_depth"][:2], [5, 1])
    assert np.isnan(s["tree_width"][2]) and np.isnan(s["tree_depth"][2])  # the chain step is a gap
    assert tree.scene() is not None and charts._tree.is_shown()
    width, depth = charts._tree.width_curve.getData(), charts._tree.depth_curve.getData()
    np.testing.assert_array_equal(width[1][:2], [64, 40])
    np.testing.assert_array_equal(depth[1][:2], [5, 1])
    # Its view box spans the same x as the other step plots': a step sits at the same x in each.
    charts.resize(400, 900)
    charts.show()
    qtbot.waitExposed(charts)
    edges = {name: charts.plots()[name].vb.sceneBoundingRect() for name in ("k", "tree", "tokens_per_s")}
    assert len({(round(r.left()), round(r.right())) for r in edges.values()}) == 1
    charts.reset()
    assert tree.scene() is None
    charts.push_steps([chain_step(0, "a", 0)])
    charts.refresh()
    assert tree.scene() is None


# --- the wire, the CSV, the stored answer ---------------------------------------------------------------


def test_the_stream_extension_round_trips_branches_and_the_tree():
    sent = steps()
    answer = RemoteAnswer(started=0.0)
    for i, step in enumerate(sent):
        chunk = wire.chunk("chat", "id", "m", 0, step.text, extra={"specdec": wire.step_tokens(step)})
        ext = json.loads(json.dumps(chunk))["specdec"]
        assert all("branch" in t and "source" in t for t in ext["tokens"])
        got = answer.step(RemotePiece(step.text, _views(ext), *_tree(ext)), now=0.01 * (i + 1))
        assert [t.branch for t in got.tokens] == [t.branch for t in step.tokens]
        assert [t.source for t in got.tokens] == [t.source for t in step.tokens]
        assert (got.tree_width, got.tree_depth) == (step.tree_width, step.tree_depth)
        assert got.sources == step.sources
    # Foreign or damaged values are dropped, not trusted.
    bad = {"step": 0, "tree_width": "64", "tree_depth": 5,
           "tokens": [{"id": 1, "text": "a", "status": "accepted", "branch": True, "source": "gpu"},
                      {"id": 2, "text": "b", "status": "accepted", "branch": -1}]}
    assert [(t.branch, t.source) for t in _views(bad)] == [(None, None), (None, None)] and _tree(bad) == (0, 0)


def test_the_remote_client_reads_branches_from_the_stream(monkeypatch):
    """Through RemoteClient.stream_chat's own parsing: a served stream of tree steps comes back with its marks."""
    from app.core.remote import RemoteClient, RemoteConfig
    from engine.types import Message

    lines = [f"data: {json.dumps(wire.chunk('chat', 'id', 'm', 0, s.text, extra={'specdec': wire.step_tokens(s)}))}"
             for s in steps()]
    lines += [f"data: {json.dumps(wire.chunk('chat', 'id', 'm', 0, None, 'stop'))}", "data: [DONE]"]

    class Response:
        status_code = 200

        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

        def iter_lines(self):
            return iter(lines)

    client = RemoteClient(RemoteConfig("http://127.0.0.1:9/v1", model="m"))
    monkeypatch.setattr(client.http, "stream", lambda *a, **k: Response())
    pieces = [e for e in client.stream_chat((Message("user", "hi"),), max_tokens=8, temperature=0,
                                            cancel=threading.Event()) if isinstance(e, RemotePiece)]
    client.close()
    assert [(p.tree_width, p.tree_depth) for p in pieces] == [(64, 5), (40, 1), (0, 0)]
    assert [t.text for p in pieces for t in p.tokens if t.branch] == [" world", " trees"]


def test_the_step_trace_csv_has_branch_and_tree_columns(tmp_path):
    sent = steps()
    summary = summarize(sent, mode="speculative", k=5, prompt_tokens=3, seconds=0.1, stop_reason="eos")
    record = AnswerRecord(GenerationRequest(request_id=4), summary, None, "2026-01-01T00:00:00+00:00", tuple(sent))
    write_trace_csv(tmp_path / "t.csv", [record])
    with open(tmp_path / "t.csv", encoding=ENCODING, newline="") as f:
        rows = list(csv.DictReader(f))
    assert TRACE_COLUMNS[-3:] == ("branch", "tree_width", "tree_depth")  # after the old columns
    assert [(r["branch"], r["tree_width"], r["tree_depth"]) for r in rows] == \
        [("0;1;0", "64", "5"), ("2", "40", "1"), ("", "0", "0")]


def test_a_stored_answer_keeps_its_branch_marks_and_older_files_still_read():
    sent = steps()
    stored = StoredTokens.from_steps(sent)
    assert stored.branches == ((1, 1), (4, 2))
    raw = json.loads(json.dumps(stored.to_json()))
    assert raw["branch"] == [[1, 1], [4, 2]]
    back = StoredTokens.from_json(raw)
    assert back == stored
    replayed = [t for s in back.to_steps() for t in s.tokens]
    assert [t.text for t in replayed if t.branch] == [" world", " trees"]
    older = {"text": raw["text"], "status": raw["status"]}  # a file written before trees
    assert StoredTokens.from_json(older).branches == () and StoredTokens.from_json(older).statuses == stored.statuses
    damaged = dict(raw, branch=[[1, 1], [99, 2]])  # an index past the tokens: the marks go, the colours stay
    assert StoredTokens.from_json(damaged) == replace(stored, branches=())
    assert "branch" not in StoredTokens.from_steps([chain_step(0, "a", 0)]).to_json()


# --- the demo ----------------------------------------------------------------------------------------


def test_the_demo_heads_rounds_are_trees_with_branches():
    engine = ScriptedEngine(delay_s=0.0)
    assert engine.info.head_name  # so the settings offer the head in the demo
    out = list(engine.generate(GenerationRequest(proposer="head", k=5, max_new_tokens=4096)))
    assert "".join(s.text for s in out) == DEMO_ANSWER
    assert all(s.tree_width == 64 and s.tree_depth == 5 for s in out)
    branches = [t for s in out for t in s.tokens if t.branch]
    assert branches and all(t.status == "accepted" and t.source == "head" for t in branches)
    assert all(t.branch == 0 for s in out for t in s.tokens if t.status == "rejected")
    # Other proposers stay chains.
    chain = scripted_steps(DEMO_ANSWER, k=5)
    assert not any(s.tree_width for s in chain) and not any(t.branch for s in chain for t in s.tokens)
