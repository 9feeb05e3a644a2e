"""The session, without Qt: the conversation, the requests in flight, settings → request, and verdicts.

The window is a view of a ChatSession (napari's ViewerModel / view split): it forwards what a
person does and what the worker reports, and shows what the session decides. Everything here is
tested without a QApplication.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from app.core.chat_tree import Conversation, ConversationFormatError, StoredTokens, Turn
from app.core.conversations import BackgroundWriter, ConversationHeader, ConversationStore
from app.core.export import AnswerRecord, now_iso
from engine.limits import K_AUTO
from engine.loadspec import LoadSpec
from engine.measure.costmodel import CostModel, estimate_alpha
from engine.measure.explain import plain_verdict
from engine.settings import GenerationSettings, ModelSelection
from engine.types import GenerationRequest, MemoryPlan, Message, ModelInfo, Sampling, Step, Summary

PROPOSER_LABELS = {"draft": "draft", "ngram": "n-gram", "draft+ngram": "draft + n-gram", "head": "draft head"}


@dataclass(frozen=True)
class TrainRequest:
    """Train a draft head for the loaded target (the app's "Train a draft head…")."""

    request_id: int  # names every training signal
    target: str | None  # the loaded target's spec (None: the packaged default)
    device: str  # where the loaded target runs; training loads its own copy there
    dtype: str  # the loaded target's dtype
    minutes: float  # the whole budget: data, training, export
    out: str  # folder for the head; its work folder (data, checkpoints, log) is out/work
    init: str | None = None  # a head folder for this target to continue training (None: a new head)
    data: tuple[str, ...] = ()  # work folders of earlier runs whose answers it trains on again (distill --data)


def load_request_for(selection: ModelSelection, *, force: bool = False) -> LoadSpec:
    """The one conversion from what the Models dialog chose to a load (engine.assemble.build_engine's)."""
    return LoadSpec(
        target=selection.target.spec(),
        draft=None if selection.no_draft else selection.draft.spec(),
        device=selection.device,
        dtype=selection.dtype,
        with_draft=not selection.no_draft,
        target_precision=selection.target_precision,
        draft_precision=selection.draft_precision,
        context=selection.context or None,
        force=force,
        memory=int(selection.memory_gib * 2**30) or None,
        runtime=selection.runtime,
        threads=selection.threads or None,
        keep_costs=True,  # Ready right after the weights load on a machine that measured this pair before
    )


def plan_for(selection: ModelSelection) -> MemoryPlan:
    """The memory plan the Models dialog shows: of what would load, on the runtime it would run on (configs and
    headers only; raises EngineError)."""
    from engine.assemble import plan_load

    return plan_load(load_request_for(selection))


def device_line(info: ModelInfo) -> str:
    """The status bar's device part: where, in what precision, which runner, and what runs without graphs."""
    where = " + ".join(info.devices) if info.devices else info.device
    target = info.target_precision or info.dtype
    draft = info.draft_precision or info.dtype
    precision = target if not info.draft_name or draft == target else f"target {target}, draft {draft}"
    line = f"{where} · {precision} · {runtime_label(info)}"
    eager = [role for role in ("target", "draft") if info.fast_path_note.startswith(role) or f"; {role}:" in
             info.fast_path_note]
    if eager:
        line += f" (no CUDA graphs for the {' and '.join(eager)})"
    # Any other note (why a fast path is off) is the device label's tooltip: "(eager)" said nothing to a reader.
    return line


def runtime_label(info: ModelInfo) -> str:
    """What runs the pair, for the status bar and the CLI: 'llama.cpp · 2 threads', the torch fast
    path's name ('cpu-onednn · 2 threads' on a CPU), and 'cpu-onednn (torch; llama.cpp unavailable (…))'
    when auto could not use llama.cpp."""
    line = info.fast_path
    if info.threads:
        line += f" · {info.threads} thread{'s' if info.threads != 1 else ''}"
        if info.threads_batch and info.threads_batch != info.threads:
            line += f" ({info.threads_batch} for prompts)"
    return f"{line} (torch; {info.runtime_note})" if info.runtime_note else line


def system_messages(settings: GenerationSettings) -> tuple[Message, ...]:
    system = settings.system_prompt.strip()
    return (Message("system", system),) if system else ()


def build_request(settings: GenerationSettings, messages: tuple[Message, ...], request_id: int = 0,
                  *, prompt: str | None = None) -> GenerationRequest:
    """The one conversion from settings to a request, for the chat, the race and the CLI.

    `messages` are rendered with the chat template (the system prompt is the caller's: see
    `system_messages`); a raw `prompt` is fed as-is when there are no messages.
    """
    return GenerationRequest(
        messages=messages,
        prompt=prompt,
        mode=settings.mode,  # type: ignore[arg-type]  # validated by GenerationSettings.clamped
        k=settings.k,
        sampling=Sampling(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                          seed=settings.seed),
        max_new_tokens=settings.max_new_tokens,
        proposer=settings.proposer,  # type: ignore[arg-type]
        request_id=request_id,
    )


def answer_header(request: GenerationRequest, info: ModelInfo | None) -> str:
    """The line above an answer: which model and how it decodes."""
    name = info.target_name if info else "model"
    proposer = PROPOSER_LABELS.get(request.proposer, request.proposer)
    if request.mode == "standard":
        return f"{name} · standard decoding"
    if request.mode == "auto":
        return f"{name} · auto: K and proposer chosen per step · {proposer}"
    k = "K auto" if request.k == K_AUTO else f"K={request.k}"
    return f"{name} · speculative · {k} · {proposer}"


def cost_verdict(info: ModelInfo | None, summary: Summary | None, proposer: str = "draft") -> tuple[str, str]:
    """(status-bar text, tooltip) from the forward costs measured at load and, once an answer
    exists, its acceptance: what speculative decoding should buy on this machine, said plainly.
    proposer: what drafted ("draft", "head", "ngram"), priced at its own cost (the draft head's
    ModelInfo.head_ms, n-gram lookup's measured ProposerCost, the draft model's forward)."""
    if info is None or not info.target_ms:
        return "", ""
    if proposer == "head":
        draft_ms = info.head_ms
    elif proposer == "ngram":
        draft_ms = next((c.per_token_ms for c in info.proposer_costs if c.source == "ngram"), 0.0)
    else:
        draft_ms = info.draft_ms
    if draft_ms <= 0:
        return "", ""
    model = replace(CostModel.from_info(info), draft_ms=draft_ms)
    k_max = model.k_max
    name = {"head": "draft head", "ngram": "n-gram lookup"}.get(proposer, "draft")
    unit = "forward" if name == "draft" else "token"
    when = "Kept from an earlier start on this machine" if info.costs_state == "kept" else "Measured at load"
    shown = f"{draft_ms:.1f}" if draft_ms >= 0.1 else f"{draft_ms:.3f}"  # n-gram lookup costs microseconds
    costs = (f"{when}: {name} {shown} ms per {unit}, target "
             + ", ".join(f"{ms:.1f} ms ({w} tok)" for w, ms in info.target_ms) + ".")
    if info.costs_state == "kept":
        costs += f" ({info.costs_note}; measured again in the background while the app is idle.)"
    if info.costs_state == "measuring":
        return (f"{name} cost: measuring", f"Measured in part before Ready ({info.costs_note}); the rest is measured "
                "while the app is idle, and then kept for the next start. No verdict until then. " + costs)
    if info.costs_state in ("disturbed", "unsteady"):
        again = ("they are measured again while the app is idle; no verdict until they agree"
                 if info.costs_state == "disturbed" else "they stayed unsteady (is the machine busy?); no verdict")
        short = f"{name} cost: measuring again" if info.costs_state == "disturbed" else f"{name} cost: unsteady"
        return short, f"The forward costs look disturbed ({info.costs_note}): {again}. " + costs
    alpha = estimate_alpha(summary) if summary is not None else None
    ratio = draft_ms / model.target_ms[1]
    if summary is None or alpha is None:
        return (f"The {name} costs {ratio:.0%} of a forward",
                costs + " Send a speculative prompt for a prediction.")
    k, best = model.best_k(alpha, k_max)
    predicted = model.predicted_speedup(alpha, summary.k) if 0 < summary.k <= k_max else None
    figures = (f"Predicted {predicted:.2f}× at K={summary.k}" if predicted is not None else f"Best K={k}: {best:.2f}×")
    # The plain verdict (explain.plain_verdict), the same words as under the answer; the figures in the tooltip.
    short = plain_verdict(ratio, alpha, predicted if predicted is not None else best, drafter=f"the {name}")
    return short, f"{figures}. " + costs + " " + model.verdict(alpha, k_max, drafter=f"the {name}")


@dataclass
class _InFlight:
    """A request the worker is answering (or has queued)."""

    request: GenerationRequest  # what was asked
    info: ModelInfo | None  # the pair that answers it
    conversation: Conversation  # the conversation its answer belongs to (even after a switch)
    turn_id: str  # the answer's turn in it: empty until the answer ends
    steps: list[Step] = field(default_factory=list)  # every step so far, for export


@dataclass(frozen=True)
class ShownTurn:
    """A turn on the shown branch with its place among the alternatives (for ‹ 2/3 ›)."""

    turn: Turn  # the turn itself
    index: int  # 0-based among its siblings
    count: int  # siblings, itself included


class ChatSession:
    """One chat: a tree of turns (editing a question or regenerating an answer forks it), the answer
    streaming now, every finished answer (for export); saved after each change when a store is given.

    Request ids come from one counter shared with the race: the worker cancels by id, so ids never
    repeat within a process.
    """

    def __init__(self, store: ConversationStore | None = None, *, keep_tokens: bool = True,
                 on_save_error: Callable[[str, str], None] | None = None) -> None:
        self.info: ModelInfo | None = None  # the pair in use
        self.conversation = Conversation()  # the conversation shown
        self.store = store  # None: nothing is saved (tests, read-only home)
        self.writer = BackgroundWriter(store, on_save_error) if store is not None else None
        self.keep_tokens = keep_tokens  # save each answer's token statuses (colours after a reload)
        self.records: list[AnswerRecord] = []  # every finished answer of the session, for export
        self.active_request: int | None = None  # the chat's answer streaming now
        self._in_flight: dict[int, _InFlight] = {}
        self._next_id = 1

    # --- ids and state ---------------------------------------------------------------------------

    def allocate_request_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def owns(self, request_id: int) -> bool:
        """Whether a worker signal about `request_id` is the chat's (not the race's)."""
        return request_id in self._in_flight

    def request(self, request_id: int) -> GenerationRequest | None:
        entry = self._in_flight.get(request_id)
        return entry.request if entry is not None else None

    def turn_of(self, request_id: int) -> str | None:
        entry = self._in_flight.get(request_id)
        return entry.turn_id if entry is not None else None

    @property
    def history(self) -> list[Message]:
        """The shown branch as chat turns (answers still streaming or failed without text left out)."""
        return list(self.conversation.messages())

    def last_question(self) -> Turn | None:
        return next((t for t in reversed(self.conversation.path()) if t.role == "user"), None)

    def can_regenerate(self) -> bool:
        return self.last_question() is not None

    def messages_for(self, settings: GenerationSettings, drop_oldest: int = 0) -> tuple[Message, ...]:
        """What a request sends: the system prompt, then the branch shown (less its `drop_oldest` turns)."""
        return system_messages(settings) + tuple(self.conversation.messages()[drop_oldest:])

    def shown(self) -> list[ShownTurn]:
        out = []
        for turn in self.conversation.path():
            siblings = [t.id for t in self.conversation.siblings(turn.id)]
            out.append(ShownTurn(turn, siblings.index(turn.id), len(siblings)))
        return out

    # --- what a person does ----------------------------------------------------------------------

    def send(self, text: str, settings: GenerationSettings, drop_oldest: int = 0) -> GenerationRequest:
        """Adds a question at the end of the branch shown; returns the request for its answer."""
        self.conversation.add(self.conversation.current, "user", text)
        return self._start(settings, drop_oldest)

    def edit(self, turn_id: str, text: str, settings: GenerationSettings, drop_oldest: int = 0) -> GenerationRequest:
        """The edited question becomes a sibling of the old one (the conversation forks there) and is answered."""
        old = self.conversation.turns[turn_id]
        assert old.role == "user", "only questions are edited"
        self.conversation.add(old.parent, "user", text)
        return self._start(settings, drop_oldest)

    def regenerate(self, settings: GenerationSettings, answer_turn: str | None = None,
                   drop_oldest: int = 0) -> tuple[GenerationRequest, str | None] | None:
        """A new version of an answer (the last one by default), beside the old one: (the request, the
        turn id of the answer it stands in for, or None); None when there is no question to answer."""
        if answer_turn is None:
            question = self.last_question()
            path = self.conversation.path()
            after = path[path.index(question) + 1:] if question is not None else []
            replaced = after[0].id if after else None
        else:
            answer = self.conversation.turns.get(answer_turn)
            question = self.conversation.turns.get(answer.parent) if answer and answer.parent else None
            replaced = answer_turn
        if question is None:
            return None
        self.conversation.current = question.id  # the new answer goes under it, beside the old one
        return self._start(settings, drop_oldest), replaced

    def switch(self, turn_id: str, delta: int) -> None:
        """Shows the previous (-1) or next (+1) version of a turn, down to that branch's newest leaf."""
        ids = [t.id for t in self.conversation.siblings(turn_id)]
        self.conversation.switch_to(ids[max(0, min(len(ids) - 1, ids.index(turn_id) + delta))])
        self.save()

    def set_trim_oldest(self, on: bool) -> None:
        """The person chose to leave the oldest turns out when the context is full (kept per conversation)."""
        self.conversation.trim_oldest = on
        self.save()

    def new_chat(self) -> int | None:
        """Shows a new, empty conversation; returns the request still streaming (its answer goes to the old one)."""
        streaming = self.active_request
        self.conversation = Conversation()
        return streaming

    # --- saved conversations ---------------------------------------------------------------------

    def open(self, conversation_id: str) -> int | None:
        """Shows a saved conversation (raises ConversationFormatError or OSError, the shown one stays then);
        returns the request still streaming, as new_chat does."""
        conversation = self.load(conversation_id)
        streaming = self.active_request
        self.conversation = conversation
        return streaming

    def load(self, conversation_id: str) -> Conversation:
        if conversation_id == self.conversation.id:
            return self.conversation
        if self.store is None:
            raise ConversationFormatError("conversations are not saved in this session")
        self.writer.settle(conversation_id)  # a save still queued is the newest version: read it, not the older file
        return self.store.load(conversation_id)

    def list(self) -> list[ConversationHeader]:
        return self.store.list() if self.store is not None else []

    def rename(self, conversation_id: str, title: str) -> None:
        conversation = self.load(conversation_id)
        conversation.rename(title)
        self.save(conversation)

    def delete(self, conversation_id: str) -> None:
        """Moves the file to the store's trash (restore() undoes it until the next start)."""
        if self.writer is not None:
            self.writer.flush()  # a queued save must not bring the file back after the delete
        if self.store is not None:
            self.store.delete(conversation_id)
        if conversation_id == self.conversation.id:
            self.conversation = Conversation()

    def restore(self, conversation_id: str) -> bool:
        return self.store is not None and self.store.restore(conversation_id)

    def save(self, conversation: Conversation | None = None) -> None:
        conversation = conversation or self.conversation
        if self.writer is not None and not conversation.is_empty():
            self.writer.save(conversation)

    def close(self) -> None:
        """Waits for the last save."""
        if self.writer is not None:
            self.writer.close()

    def _start(self, settings: GenerationSettings, drop_oldest: int) -> GenerationRequest:
        rid = self.allocate_request_id()
        request = build_request(settings, self.messages_for(settings, drop_oldest), rid)
        model = ""
        if self.info is not None:
            model = self.info.target_name + (f" + {self.info.draft_name}" if self.info.draft_name else "")
        # The answer's turn exists from the start (empty), so a fork made meanwhile cannot misplace it.
        turn = self.conversation.add(self.conversation.current, "assistant", "", model=model,
                                     request=replace(request, messages=()))
        self.conversation.settings = asdict(settings)
        self._in_flight[rid] = _InFlight(request, self.info, self.conversation, turn.id)
        self.active_request = rid
        return request

    # --- what the worker reports -----------------------------------------------------------------

    def add_steps(self, request_id: int, steps: tuple[Step, ...]) -> bool:
        entry = self._in_flight.get(request_id)
        if entry is None:
            return False
        entry.steps.extend(steps)
        return True

    def finish(self, request_id: int, summary: Summary) -> AnswerRecord | None:
        """Records a finished answer (its turn gets the text, figures and tokens); None if it is not ours."""
        entry = self._in_flight.pop(request_id, None)
        if entry is None:
            return None
        self._complete(entry, summary.text, summary, "")
        record = AnswerRecord(entry.request, summary, entry.info, now_iso(), tuple(entry.steps))
        self.records.append(record)
        self._end(request_id)
        return record

    def fail(self, request_id: int, message: str = "") -> bool:
        entry = self._in_flight.pop(request_id, None)
        if entry is None:
            return False
        self._complete(entry, "".join(s.text for s in entry.steps), None, message or "generation failed")
        self._end(request_id)
        return True

    def _complete(self, entry: _InFlight, text: str, summary: Summary | None, error: str) -> None:
        conversation = entry.conversation
        tokens = StoredTokens.from_steps(entry.steps) if self.keep_tokens and entry.steps else None
        turn = replace(conversation.turns[entry.turn_id], content=text, summary=summary, error=error, tokens=tokens)
        conversation.replace_turn(turn)
        self.save(conversation)

    def _end(self, request_id: int) -> None:
        if request_id == self.active_request:
            self.active_request = None
