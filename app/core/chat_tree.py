"""One conversation as a tree of turns: editing a question or regenerating an answer forks a branch."""
from __future__ import annotations

import enum
import functools
import re
import types
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from datetime import datetime
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from engine.types import Decision, GenerationRequest, Message, Sampling, Step, Summary, TokenView

FORMAT = "specdec-studio.conversation"  # every file we write says what it is, so foreign JSON is refused
VERSION = 1  # bump when the layout changes; a file from a newer version is reported, never rewritten
TITLE_CHARS = 60  # a new conversation is titled by its first prompt, cut to this
# A conversation id is its file's stem: letters, digits, "_", "-", "." (not first); never a path.
ID_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")

# One letter per token status in a stored answer: a compact string instead of a list of words.
STATUS_CODES = {"accepted": "a", "rejected": "r", "corrected": "c", "bonus": "b", "target": "t"}
CODE_STATUSES = {v: k for k, v in STATUS_CODES.items()}
_STEP_ENDS = ("corrected", "bonus", "target")  # the target's own token closes a step

Role = Literal["user", "assistant"]


class ConversationFormatError(ValueError):
    """A file that is not a conversation we can read: damaged, foreign, or from a newer version."""


def now_iso() -> str:
    # Milliseconds: two changes within a second still sort in the order they happened.
    return datetime.now().astimezone().isoformat(timespec="milliseconds")


def new_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class StoredTokens:
    """An answer's tokens as shown while it streamed, enough to colour it again after a reload."""

    texts: tuple[str, ...]  # each token's text, rejected drafts included, in display order
    statuses: str  # one STATUS_CODES letter per token
    # (token index, rank) of each token a draft tree's branch brought (TokenView.branch > 0), for its mark
    branches: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_steps(cls, steps: Iterable[Step]) -> StoredTokens:
        texts: list[str] = []
        codes: list[str] = []
        branches: list[tuple[int, int]] = []
        for step in steps:
            for token in step.tokens:
                if token.branch:
                    branches.append((len(texts), token.branch))
                texts.append(token.text)
                codes.append(STATUS_CODES[token.status])
        return cls(tuple(texts), "".join(codes), tuple(branches))

    def to_steps(self) -> list[Step]:
        """Steps that replay these tokens into a token view: a step ends at the target's own token.

        The numbers behind each token (p, q) are not kept, so tooltips show the status and step only.
        """
        steps: list[Step] = []
        views: list[TokenView] = []
        total = 0

        def close() -> None:
            nonlocal total, views
            text = "".join(v.text for v in views if v.status != "rejected")
            new = sum(1 for v in views if v.status != "rejected")
            total += new
            proposed = sum(1 for v in views if v.draft_pos is not None)
            accepted = sum(1 for v in views if v.status == "accepted")
            end = views[-1].status if views[-1].status in _STEP_ENDS else None
            steps.append(Step(
                index=len(steps), mode="standard" if end == "target" else "speculative",
                proposed=(0,) * proposed, proposed_q=(), proposed_p=(), sources=(), accepted=accepted,
                added=None, added_status=end, tokens=tuple(views), text=text,  # type: ignore[arg-type]
                new_tokens=new, total_tokens=total, draft_ms=0.0, verify_ms=0.0, elapsed_s=0.0,
            ))
            views = []

        drafted = 0
        branches = dict(self.branches)
        for i, (text, code) in enumerate(zip(self.texts, self.statuses)):
            status = CODE_STATUSES.get(code, "target")
            is_draft = status in ("accepted", "rejected")
            views.append(TokenView(0, text, status, len(steps), drafted if is_draft else None,  # type: ignore[arg-type]
                                   None, None, None, None, branches.get(i)))
            drafted = drafted + 1 if is_draft else 0
            if status in _STEP_ENDS:
                close()
        if views:
            close()
        return steps

    def to_json(self) -> dict[str, Any]:
        raw: dict[str, Any] = {"text": list(self.texts), "status": self.statuses}
        if self.branches:  # only answers with tree rounds have the key; older readers ignore it
            raw["branch"] = [list(b) for b in self.branches]
        return raw

    @classmethod
    def from_json(cls, raw: Any) -> StoredTokens | None:
        if not isinstance(raw, dict):
            return None
        texts, statuses = raw.get("text"), raw.get("status")
        if not isinstance(texts, list) or not isinstance(statuses, str) or len(texts) != len(statuses):
            return None  # colours are optional: a damaged token list loses the colours, not the answer
        if not all(isinstance(t, str) for t in texts):
            return None
        return cls(tuple(texts), statuses, _branches(raw.get("branch", []), len(texts)))


def _branches(raw: Any, count: int) -> tuple[tuple[int, int], ...]:
    """Stored [index, rank] pairs; a damaged list loses the branch marks, not the colours."""
    def fits(pair: Any) -> bool:
        return (isinstance(pair, list) and len(pair) == 2 and all(type(v) is int for v in pair)
                and 0 <= pair[0] < count and pair[1] > 0)

    if not isinstance(raw, list) or not all(fits(pair) for pair in raw):
        return ()
    return tuple((index, rank) for index, rank in raw)


@dataclass(frozen=True)
class Turn:
    """One message of the tree. Answers also keep what produced them and their figures."""

    id: str  # unique within its conversation
    parent: str | None  # the turn it answers or follows; None for a first question
    role: Role  # "user" or "assistant"
    content: str  # the text (an answer's committed text, rejected drafts left out)
    created: str  # ISO 8601 with offset
    model: str = ""  # answers: "target + draft" names of the pair that wrote it
    request: GenerationRequest | None = None  # answers: the settings used (messages left out)
    summary: Summary | None = None  # answers: the figures (None for one that failed before finishing)
    tokens: StoredTokens | None = None  # answers: the coloured tokens, when kept
    error: str = ""  # answers: the one-line error if generation failed

    def message(self) -> Message:
        return Message(self.role, self.content)


def _request_json(request: GenerationRequest) -> dict[str, Any]:
    raw = asdict(request)
    raw.pop("messages", None)  # the tree holds them; a copy per answer would grow quadratically
    raw.pop("prompt", None)
    raw.pop("request_id", None)  # a session-local counter, meaningless after a restart
    return raw


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the type a dataclass field declares (ints are floats; bools are not ints)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(_fits(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):  # stored as its value (ProposerChoice: a word)
        return any(value == m.value and type(value) is type(m.value) for m in hint)
    return False


_hints = functools.cache(get_type_hints)  # resolved once per dataclass, not once per stored answer


def _typed(cls: type, raw: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """The fields of `cls` found in `raw`, each of its declared type (tuples made tuples); None if one is not."""
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in skip or f.name not in raw:
            continue
        value = raw[f.name]
        if not _fits(value, hints[f.name]):
            return None
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return values


def _request_from(raw: Any) -> GenerationRequest | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("sampling", {}), dict):
        return None
    sampling = _typed(Sampling, raw.get("sampling", {}))
    kept = _typed(GenerationRequest, raw, skip=("sampling", "messages", "prompt", "request_id"))
    if sampling is None or kept is None:
        return None  # a damaged request loses the settings shown, not the answer
    return GenerationRequest(sampling=Sampling(**sampling), **kept)


def _summary_json(summary: Summary) -> dict[str, Any]:
    raw = asdict(summary)
    raw.pop("text", None)  # it is the turn's content
    return raw


def _summary_from(raw: Any, text: str) -> Summary | None:
    if not isinstance(raw, dict):
        return None
    # Fields added later (with defaults) may be missing from older files; the others must be there.
    if any(f.default is MISSING and f.name != "text" and f.name not in raw for f in fields(Summary)):
        return None
    values = _typed(Summary, raw, skip=("text", "decision"))
    if values is None:
        return None  # a damaged summary loses the figures, not the answer
    decision = raw.get("decision")
    if isinstance(decision, dict):
        kept = _typed(Decision, decision)
        required = all(f.name in decision for f in fields(Decision) if f.default is MISSING)
        values["decision"] = Decision(**kept) if kept is not None and required else None
    return Summary(text=text, **values)


def turn_to_json(turn: Turn) -> dict[str, Any]:
    raw: dict[str, Any] = {"id": turn.id, "parent": turn.parent, "role": turn.role, "content": turn.content,
                           "created": turn.created}
    if turn.role == "assistant":
        raw["model"] = turn.model
        if turn.request is not None:
            raw["request"] = _request_json(turn.request)
        if turn.summary is not None:
            raw["summary"] = _summary_json(turn.summary)
        if turn.tokens is not None:
            raw["tokens"] = turn.tokens.to_json()
        if turn.error:
            raw["error"] = turn.error
    return raw


def turn_from_json(raw: Any) -> Turn:
    if not isinstance(raw, dict) or raw.get("role") not in ("user", "assistant"):
        raise ConversationFormatError("a message has no role")
    ident, content = raw.get("id"), raw.get("content")
    if not isinstance(ident, str) or not ident or not isinstance(content, str):
        raise ConversationFormatError("a message has no id or text")
    parent = raw.get("parent")
    return Turn(
        id=ident, parent=parent if isinstance(parent, str) else None, role=raw["role"], content=content,
        created=_text(raw, "created"), model=_text(raw, "model"),
        request=_request_from(raw.get("request")), summary=_summary_from(raw.get("summary"), content),
        tokens=StoredTokens.from_json(raw.get("tokens")), error=_text(raw, "error"),
    )


def _text(raw: dict[str, Any], key: str) -> str:
    """A text field, or "" when it is missing or not text (an unknown or damaged field is ignored)."""
    value = raw.get(key, "")
    return value if isinstance(value, str) else ""


def _cut_cycles(turns: dict[str, Turn]) -> None:
    """A parent chain that comes back to itself (a damaged or crafted file) is cut where it repeats."""
    done: set[str] = set()
    for start in list(turns):
        chain: list[str] = []
        on_chain: set[str] = set()
        node: str | None = start
        while node is not None and node not in done:
            if node in on_chain:  # the last turn walked points back into its own chain: it starts a branch
                turns[chain[-1]] = replace(turns[chain[-1]], parent=None)
                break
            on_chain.add(node)
            chain.append(node)
            node = turns[node].parent
        done.update(chain)


@dataclass
class Conversation:
    """A titled tree of turns and the leaf being shown. Mutated on the UI thread only; its turns are
    frozen, so a snapshot (`to_json`) can be written on another thread."""

    id: str = field(default_factory=new_id)  # also the file name
    title: str = ""  # first prompt, or what the person renamed it to
    created: str = field(default_factory=now_iso)  # ISO 8601
    updated: str = field(default_factory=now_iso)  # ISO 8601, the last change
    model: str = ""  # the pair of the latest answer, for the sidebar
    settings: dict[str, Any] = field(default_factory=dict)  # generation settings of the latest request
    turns: dict[str, Turn] = field(default_factory=dict)  # by id, in creation order
    current: str | None = None  # the leaf whose path is shown; None for an empty conversation
    trim_oldest: bool = False  # the person chose to drop the oldest turns when the context is full

    # --- reading the tree ---------------------------------------------------------------------

    def path(self, leaf: str | None = None) -> list[Turn]:
        """Root to `leaf` (the current leaf by default): the conversation as shown and as sent."""
        out: list[Turn] = []
        seen: set[str] = set()
        node = self.turns.get(leaf if leaf is not None else self.current or "")
        while node is not None and node.id not in seen:  # a repeat would be a cycle: cut there
            seen.add(node.id)
            out.append(node)
            node = self.turns.get(node.parent) if node.parent is not None else None
        out.reverse()
        return out

    def messages(self) -> tuple[Message, ...]:
        """The shown path as chat messages (failed answers left out: they have nothing to say)."""
        return tuple(t.message() for t in self.path() if not (t.role == "assistant" and not t.content))

    def children(self, turn_id: str | None) -> list[Turn]:
        return [t for t in self.turns.values() if t.parent == turn_id]

    def siblings(self, turn_id: str) -> list[Turn]:
        """The alternatives at this turn's place (itself included), oldest first."""
        turn = self.turns[turn_id]
        return [t for t in self.turns.values() if t.parent == turn.parent and t.role == turn.role]

    def is_empty(self) -> bool:
        return not self.turns

    # --- changing it ----------------------------------------------------------------------------

    def add(self, parent: str | None, role: Role, content: str, **answer: Any) -> Turn:
        """A new turn under `parent`; it becomes the current leaf (a fork when `parent` had children)."""
        if parent is not None and parent not in self.turns:
            raise KeyError(f"no turn {parent!r} in conversation {self.id}")
        turn = Turn(id=new_id(), parent=parent, role=role, content=content, created=now_iso(), **answer)
        self.turns[turn.id] = turn
        self.current = turn.id
        if role == "user" and not self.title:
            self.title = title_from(content)
        if turn.model:
            self.model = turn.model
        self.touch()
        return turn

    def replace_turn(self, turn: Turn) -> None:
        """An answer finished (or failed): its figures and tokens replace the placeholder."""
        assert turn.id in self.turns, "replace_turn needs an existing turn"
        self.turns[turn.id] = turn
        if turn.model:
            self.model = turn.model
        self.touch()

    def switch_to(self, turn_id: str) -> None:
        """Shows the branch through `turn_id`, down to its newest leaf."""
        node = self.turns[turn_id]
        seen = {node.id}
        while True:
            kids = [k for k in self.children(node.id) if k.id not in seen]
            if not kids:
                break
            node = kids[-1]
            seen.add(node.id)
        self.current = node.id

    def rename(self, title: str) -> None:
        self.title = title.strip() or self.title
        self.touch()

    def touch(self) -> None:
        self.updated = now_iso()

    # --- files ----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "id": self.id, "title": self.title, "created": self.created,
            "updated": self.updated, "model": self.model, "settings": dict(self.settings),
            "current": self.current, "trim_oldest": self.trim_oldest,
            "turns": [turn_to_json(t) for t in self.turns.values()],
        }

    @classmethod
    def from_json(cls, raw: Any) -> Conversation:
        check_header(raw)
        turns: dict[str, Turn] = {}
        for item in raw.get("turns", []):
            turn = turn_from_json(item)
            turns[turn.id] = turn
        for turn in list(turns.values()):  # a turn whose parent is missing (or itself) starts its own branch
            if turn.parent is not None and (turn.parent not in turns or turn.parent == turn.id):
                turns[turn.id] = replace(turn, parent=None)
        _cut_cycles(turns)
        current = raw.get("current")
        conversation = cls(
            id=raw["id"], title=_text(raw, "title"), created=_text(raw, "created"),
            updated=_text(raw, "updated"), model=_text(raw, "model"),
            settings=raw["settings"] if isinstance(raw.get("settings"), dict) else {},
            turns=turns, current=current if isinstance(current, str) and current in turns else None,
            trim_oldest=raw.get("trim_oldest") is True,
        )
        if conversation.current is None and turns:
            conversation.current = list(turns)[-1]
        return conversation


def check_header(raw: Any) -> None:
    """Raises ConversationFormatError unless `raw` is a conversation this version can read."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConversationFormatError("not a SpecDec Studio conversation")
    version = raw.get("version")
    if not isinstance(version, int) or version < 1:
        raise ConversationFormatError("no version number")
    if version > VERSION:
        raise ConversationFormatError(f"saved by a newer SpecDec Studio (format {version}; this one reads {VERSION})")
    if not isinstance(raw.get("id"), str) or not raw["id"]:
        raise ConversationFormatError("no conversation id")
    if not ID_PATTERN.fullmatch(raw["id"]):
        raise ConversationFormatError("its id is not a plain file name")
    if not isinstance(raw.get("turns", []), list):
        raise ConversationFormatError("its messages are not a list")


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


def search_text(conversation: Conversation) -> str:
    """Everything a search by text looks at: the title and every message of every branch."""
    return "\n".join([conversation.title, *(t.content for t in conversation.turns.values())])


def messages_fitting(messages: Sequence[Message], counts: Sequence[int], budget: int) -> int:
    """How many of the oldest messages to leave out so that the rest fit `budget` tokens.

    Whole turns go (a question with its answer), the newest message always stays.
    """
    total = sum(counts)
    drop = 0
    while total > budget and drop < len(messages) - 1:
        total -= counts[drop]
        drop += 1
        # never start the kept context with an answer: its question went with the turn
        while drop < len(messages) - 1 and messages[drop].role == "assistant":
            total -= counts[drop]
            drop += 1
    return drop
