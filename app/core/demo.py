"""A scripted stand-in engine (no torch): streams synthetic speculative Steps for demos, tests and benchmarks."""
from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from engine.errors import GenerationError
from engine.limits import K_AUTO, K_MAX, TREE_FRONTIER, TREE_K_MAX, TREE_NODES, tree_nodes
from engine.measure.stats import summarize
from engine.types import (
    Decision,
    GenerationRequest,
    ModelInfo,
    PrefillProgress,
    Step,
    StopReason,
    Summary,
    TokenView,
)

log = logging.getLogger(__name__)

DEMO_ANSWER = (
    "快速排序（quicksort）是一种分治算法：先选一个基准元素，再把数组分成两部分。\n"
    "Here is a short, readable Python version:\n\n"
    "```python\n"
    "def quicksort(items: list[int]) -> list[int]:\n"
    "    if len(items) <= 1:\n"
    "        return items\n"
    "    pivot, *rest = items\n"
    "    left = [x for x in rest if x < pivot]\n"
    "    right = [x for x in rest if x >= pivot]\n"
    "    return quicksort(left) + [pivot] + quicksort(right)\n"
    "```\n\n"
    "平均时间复杂度是 O(n log n)，最坏情况是 O(n²)。The draft model guesses most of the "
    "boilerplate, and the target only corrects the interesting tokens."
)

DEMO_AUTO_K = 4  # the K the scripted controller "chooses" when K is auto

DEMO_INFO = ModelInfo(
    target_name="demo-target", draft_name="demo-draft", device="cpu", dtype="float32",
    fast_path="scripted", vocab_size=1000, head_name="demo-head",  # the head drafts trees (scripted_steps)
)
BRANCH_SHARE = 0.15  # in a scripted tree round, the share of accepted levels matched by a branch (rank 1..3)

# Words, a space plus a word, single CJK characters in pairs, newlines, runs of spaces, punctuation.
_PIECES = re.compile(r" ?[A-Za-z_]+|\d|\n|[ \t]+|[\u4e00-\u9fff]{1,2}|.", re.DOTALL)
_GHOSTS = (" the", " a", " of", "的", " list", " x", "，", " in", " return", " value")


def split_tokens(text: str) -> list[str]:
    """Cheap word-ish tokenization; joining the pieces gives back the text exactly."""
    pieces = _PIECES.findall(text)
    assert "".join(pieces) == text, "the token pattern must cover every character"
    return pieces


def scripted_steps(
    text: str,
    *,
    mode: str = "speculative",
    k: int = 5,
    acceptance: float = 0.8,
    seed: int = 0,
    step_ms: float = 10.0,
    source: str = "draft",
    adaptive: bool = False,
    tree: bool = False,
) -> list[Step]:
    """Steps that commit exactly `text`, with rejections drawn per draft position at `acceptance`.

    `adaptive`: the steps say the K controller chose their K (as with K auto and auto mode). `tree`: rounds
    verified as dynamic draft trees (as the engine's head drafts them, engine/heads/tree.py): K levels (about K
    when adaptive) of the default tree's nodes, some tokens accepted through a branch (TokenView.branch > 0)."""
    rng = random.Random(seed)
    tokens = split_tokens(text)
    steps: list[Step] = []
    pos = total = 0
    token_id = 0
    while pos < len(tokens):
        index = len(steps)
        views: list[TokenView] = []
        if mode == "standard":
            piece = tokens[pos]
            views.append(TokenView(token_id, piece, "target", index, None, None, 0.9, None, None))
            token_id += 1
            proposed: tuple[int, ...] = ()
            accepted, added_status, committed = 0, "target", [piece]
        elif tree:
            depth = max(2, min(TREE_K_MAX, k + rng.choice((-1, 0, 0, 1)))) if adaptive else k
            views, committed, rejected = _tree_round(rng, tokens[pos:], depth, acceptance, index, token_id, source)
            accepted = len(committed) - 1
            proposed = tuple(range(token_id, token_id + accepted + rejected))
            token_id += len(views)
            added_status = views[-1].status
        else:
            drawn = 0
            while drawn < k and rng.random() < acceptance:
                drawn += 1
            # At the end of the script the draft runs out: what remains is accepted, the last piece added.
            accepted = min(drawn, len(tokens) - pos - 1)
            committed = tokens[pos : pos + accepted + 1]
            rejected = k - drawn if accepted == drawn and drawn < k else 0
            proposed = tuple(range(token_id, token_id + accepted + rejected))
            for i, piece in enumerate(committed[:accepted]):
                views.append(TokenView(token_id, piece, "accepted", index, i, 0.8, 0.9, 1.0, source))
                token_id += 1
            for j in range(rejected):
                ghost = rng.choice(_GHOSTS)
                views.append(TokenView(token_id, ghost, "rejected", index, accepted + j, 0.6, 0.1, 0.17, source))
                token_id += 1
            added_status = "corrected" if rejected else "bonus"
            views.append(TokenView(token_id, committed[-1], added_status, index, None, None, 0.7, None, None))
            token_id += 1
        pos += len(committed)
        total += len(committed)
        draft_ms = 0.0 if mode == "standard" else step_ms * 0.3
        shape = {"tree_width": tree_nodes(TREE_NODES, TREE_FRONTIER, depth), "tree_depth": depth} \
            if tree and mode != "standard" else {}
        chosen = shape.get("tree_depth", k)  # a tree round's K is its levels (engine/decoding/describe.py)
        decision = (Decision(chosen, source, "best", acceptance, 1.0 + acceptance * 1.5, chosen,  # type: ignore[arg-type]
                             1.0 + acceptance * 1.5) if adaptive else None)
        steps.append(Step(
            index=index, mode="standard" if mode == "standard" else "speculative",
            proposed=proposed, proposed_q=(0.8,) * len(proposed), proposed_p=(0.5,) * len(proposed),
            sources=(source,) * len(proposed),  # type: ignore[arg-type]
            accepted=accepted, added=token_id - 1, added_status=added_status,  # type: ignore[arg-type]
            tokens=tuple(views), text="".join(committed), new_tokens=len(committed), total_tokens=total,
            draft_ms=draft_ms, verify_ms=step_ms - draft_ms, elapsed_s=(index + 1) * step_ms / 1000.0,
            decision=decision, **shape,
        ))
    return steps


def _tree_round(rng: random.Random, rest: list[str], depth: int, acceptance: float, index: int, token_id: int,
                source: str) -> tuple[list[TokenView], list[str], int]:
    """One scripted tree round over the text still to come: (views, committed pieces, rejected drafts shown).

    The target walks the tree down while some child at a level matches: likelier than one chain token, as
    the siblings are tried too; a level in BRANCH_SHARE is matched by a later choice (rank 1..3). Where the walk
    stops, the drafter's first choice there is shown rejected (none at a leaf: the added token is a bonus)."""
    reach = acceptance + (1.0 - acceptance) * 0.5  # a level of siblings matches more often than one token
    drawn = 0
    while drawn < depth and rng.random() < reach:
        drawn += 1
    accepted = min(drawn, len(rest) - 1)
    views: list[TokenView] = []
    for i, piece in enumerate(rest[:accepted]):
        rank = rng.choice((1, 1, 2, 3)) if rng.random() < BRANCH_SHARE else 0
        q = 0.8 if rank == 0 else 0.3 / rank
        views.append(TokenView(token_id + i, piece, "accepted", index, i, q, 0.9, 1.0, source, rank))  # type: ignore[arg-type]
    rejected = 1 if accepted == drawn < depth else 0
    if rejected:
        views.append(TokenView(token_id + accepted, rng.choice(_GHOSTS), "rejected", index, accepted, 0.6, 0.1, 0.1,
                               source, 0))  # type: ignore[arg-type]
    status = "corrected" if rejected else "bonus"
    views.append(TokenView(token_id + len(views), rest[accepted], status, index, None, None, 0.7, None, None))
    return views, rest[: accepted + 1], rejected


class ScriptedGeneration(Iterator[Step]):
    """Yields pre-built Steps with a real delay each; `summary` is set once iteration ends."""

    def __init__(self, steps: list[Step], request: GenerationRequest, cancel: threading.Event,
                 delay_s: float, fail_at: int | None, fail_with: Callable[[], BaseException] | None) -> None:
        self.request = request
        self.summary: Summary | None = None
        self._it = self._run(steps, cancel, delay_s, fail_at, fail_with)

    def __next__(self) -> Step:
        return next(self._it)

    def _run(self, steps: list[Step], cancel: threading.Event, delay_s: float,
             fail_at: int | None, fail_with: Callable[[], BaseException] | None) -> Iterator[Step]:
        req = self.request
        t0 = time.perf_counter()
        out: list[Step] = []
        # Whole steps only: the script is illustrative, not a tokenizer.
        kept = [s for s in steps if s.total_tokens <= req.max_new_tokens] or steps[:1]
        stop: StopReason = "eos" if len(kept) == len(steps) else "max_new_tokens"
        for i, step in enumerate(kept):
            # An absolute schedule (not sleep-after-work) keeps the rate exact; cancel.wait doubles as
            # the delay so that a stop is noticed at once.
            wait = t0 + (i + 1) * delay_s - time.perf_counter()
            if cancel.wait(wait) if wait > 0 else cancel.is_set():
                stop = "cancelled"
                break
            if fail_at is not None and i == fail_at:
                raise (fail_with() if fail_with else GenerationError("scripted failure"))
            last = i == len(kept) - 1
            step = replace(step, elapsed_s=time.perf_counter() - t0, stop_reason=stop if last else None)
            out.append(step)
            yield step
        k = req.k if req.mode == "speculative" else 0  # K_AUTO (0) when chosen per step
        self.summary = summarize(out, mode=req.mode, k=k, prompt_tokens=12,
                                 seconds=max(time.perf_counter() - t0, 1e-6), stop_reason=stop)


@dataclass
class ScriptedEngine:
    """Engine-like: `.info` and `.generate(request, cancel)`; answers every request with `text`."""

    text: str = DEMO_ANSWER
    delay_s: float = 0.03  # wall time per step
    acceptance: float = 0.8  # per-position acceptance of the synthetic drafts
    info: ModelInfo = DEMO_INFO
    fail_at: int | None = None  # raise before this step index (tests of generation_failed)
    fail_with: Callable[[], BaseException] | None = None  # exception factory for fail_at
    requests_seen: int = 0  # how many generations were started (tests of regenerate)
    context_length: int = 32768  # tokens the "model" holds (the context meter reads it)

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None,
                 progress: Callable[[PrefillProgress], None] | None = None) -> ScriptedGeneration:
        """progress: told that the scripted prompt (12 tokens) was read, at once."""
        if request.mode == "speculative" and not K_AUTO <= request.k <= K_MAX:
            raise GenerationError(f"K must be 1..{K_MAX}, or auto (got {request.k}).")
        self.requests_seen += 1
        if progress is not None:
            progress(PrefillProgress("target", 0, 11))
            progress(PrefillProgress("target", 11, 11))
        source = {"ngram": "ngram", "head": "head"}.get(request.proposer, "draft")
        adaptive = request.mode == "auto" or request.k == K_AUTO
        steps = scripted_steps(self.text, mode=request.mode, k=DEMO_AUTO_K if adaptive else request.k,
                               acceptance=self.acceptance, seed=request.sampling.seed + self.requests_seen,
                               step_ms=self.delay_s * 1000 or 1.0, source=source, adaptive=adaptive,
                               tree=source == "head")  # the head's rounds are trees, as in the engine
        return ScriptedGeneration(steps, request, cancel or threading.Event(), self.delay_s,
                                  self.fail_at, self.fail_with)


DEMO_TITLES = (
    "Explain quicksort with code", "写一首关于秋天的短诗", "Binary search in Rust", "What is speculative decoding?",
    "SQL: top 3 per group", "Regex for ISO dates", "解释一下 Transformer 的注意力机制", "Dockerfile for a Flask app",
    "Big-O of heapsort", "Bash: rename files in bulk",
)


def demo_conversations(store, count: int, turns: int = 6, answer: str = DEMO_ANSWER, *,
                       tokens: bool = True, seed: int = 0) -> list[str]:
    """Writes `count` saved conversations of `turns` messages each (half questions, half scripted
    answers with their token statuses) into a ConversationStore; returns their ids, newest first.
    For screenshots, benchmarks and tests of a long history; nothing here needs a model."""
    from datetime import datetime, timedelta

    from app.core.chat_tree import Conversation, StoredTokens

    steps = scripted_steps(answer, k=5, acceptance=0.8, seed=seed)
    summary = summarize(steps, mode="speculative", k=5, prompt_tokens=40, seconds=steps[-1].elapsed_s,
                        stop_reason="eos")
    stored = StoredTokens.from_steps(steps) if tokens else None
    request = GenerationRequest(k=5, max_new_tokens=1024)
    ids = []
    start = datetime(2026, 11, 1, 9, 0).astimezone()
    for i in range(count):
        conversation = Conversation()
        for t in range(turns // 2):
            question = f"{DEMO_TITLES[(i + t) % len(DEMO_TITLES)]} (part {t + 1})"
            conversation.add(conversation.current, "user", question)
            # Every answer differs (by its last line), so nothing is rendered once and reused.
            suffix = f"\n\nNote {i}.{t}: done."
            tokens_of = StoredTokens(stored.texts + (suffix,), stored.statuses + "b") if stored else None
            conversation.add(conversation.current, "assistant", answer + suffix, model="demo-target + demo-draft",
                             request=request, summary=replace(summary, text=answer + suffix), tokens=tokens_of)
        conversation.title = DEMO_TITLES[i % len(DEMO_TITLES)]
        conversation.updated = (start + timedelta(hours=i)).isoformat(timespec="seconds")
        store.save(conversation)
        ids.append(conversation.id)
    return ids[::-1]
