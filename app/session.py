"""The session, without Qt: the conversation, the requests in flight, settings → request, and verdicts.

The window is a view of a ChatSession (napari's ViewerModel / view split): it forwards what a
person does and what the worker reports, and shows what the session decides. Everything here is
tested without a QApplication.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from app.export import AnswerRecord, now_iso
from engine.measure.costmodel import CostModel, estimate_alpha
from engine.settings import GenerationSettings, ModelSelection
from engine.types import GenerationRequest, MemoryPlan, Message, ModelInfo, Sampling, Step, Summary

PROPOSER_LABELS = {"draft": "draft", "ngram": "n-gram", "draft+ngram": "draft + n-gram"}


@dataclass(frozen=True)
class LoadRequest:
    """Which pair to load and how; `None` model specs mean the packaged default."""

    target: str | None = None  # folder, .gguf file, hub id, or None for the default target
    draft: str | None = None  # same for the draft; ignored when with_draft is False
    device: str = "auto"  # auto / cpu / cuda / cuda:N
    dtype: str = "auto"  # auto / bfloat16 / float16 / float32
    with_draft: bool = True  # False: target only (n-gram proposer or standard decoding)
    fast_path: str = "auto"  # auto / eager / static / compiled, passed to Engine.from_pair
    target_dtype: str = "auto"  # the target's precision: auto / a float dtype / int8 / nf4
    draft_dtype: str = "auto"  # the draft's precision
    context: int | None = None  # positions each KV cache holds (None: the default)
    force: bool = False  # load even when the memory plan says it will not fit (a person said so)
    memory: int | None = None  # memory budget per device in bytes (None: what the device has free)


def load_request_for(selection: ModelSelection, *, force: bool = False) -> LoadRequest:
    """The one conversion from what the Models dialog (or the command line) chose to a load."""
    return LoadRequest(
        target=selection.target.spec(),
        draft=None if selection.no_draft else selection.draft.spec(),
        device=selection.device,
        dtype=selection.dtype,
        with_draft=not selection.no_draft,
        target_dtype=selection.target_precision,
        draft_dtype=selection.draft_precision,
        context=selection.context or None,
        force=force,
        memory=int(selection.memory_gib * 2**30) or None,
    )


def plan_for(selection: ModelSelection) -> MemoryPlan:
    """The memory plan of what the Models dialog shows (configs and headers only; raises EngineError)."""
    from engine.models.planner import plan_pair

    return plan_pair(selection.target.spec(), None if selection.no_draft else selection.draft.spec(),
                     with_draft=not selection.no_draft, device=selection.device, dtype=selection.dtype,
                     target_precision=selection.target_precision, draft_precision=selection.draft_precision,
                     context=selection.context or None, memory=int(selection.memory_gib * 2**30) or None)


def device_line(info: ModelInfo) -> str:
    """The status bar's device part: where, in what precision, which runner, and what runs without graphs."""
    where = " + ".join(info.devices) if info.devices else info.device
    target = info.target_precision or info.dtype
    draft = info.draft_precision or info.dtype
    precision = target if not info.draft_name or draft == target else f"target {target}, draft {draft}"
    line = f"{where} · {precision} · {info.fast_path}"
    eager = [role for role in ("target", "draft") if info.fast_path_note.startswith(role) or f"; {role}:" in
             info.fast_path_note]
    if eager:
        line += f" (no CUDA graphs for the {' and '.join(eager)})"
    elif info.fast_path_note:
        line += " (eager)"
    return line


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
    if request.mode == "standard":
        return f"{name} · standard decoding"
    return f"{name} · speculative · K={request.k} · {PROPOSER_LABELS.get(request.proposer, request.proposer)}"


def cost_verdict(info: ModelInfo | None, summary: Summary | None) -> tuple[str, str]:
    """(status-bar text, tooltip) from the forward costs measured at load and, once an answer
    exists, its acceptance: what speculative decoding should buy on this machine, said plainly."""
    if info is None or not info.target_ms or info.draft_ms <= 0:
        return "", ""
    model = CostModel.from_info(info)
    k_max = model.k_max
    costs = (f"Measured at load: draft {info.draft_ms:.1f} ms per forward, target "
             + ", ".join(f"{ms:.1f} ms ({w} tok)" for w, ms in info.target_ms) + ".")
    alpha = estimate_alpha(summary) if summary is not None else None
    if summary is None or alpha is None:
        ratio = info.draft_ms / model.target_ms[1]
        return f"draft = {ratio:.0%} of a target forward", costs + " Send a speculative prompt for a prediction."
    k, best = model.best_k(alpha, k_max)
    predicted = model.predicted_speedup(alpha, summary.k) if summary.k <= k_max else None
    short = (f"predicted {predicted:.2f}× at K={summary.k}" if predicted is not None else f"best K={k}: {best:.2f}×")
    return short, costs + " " + model.verdict(alpha, k_max)


@dataclass
class _InFlight:
    """A request the worker is answering (or has queued)."""

    request: GenerationRequest  # what was asked
    info: ModelInfo | None  # the pair that answers it
    steps: list[Step] = field(default_factory=list)  # every step so far, for export


class ChatSession:
    """One chat: its turns, the answer streaming now, every finished answer (for export).

    Request ids come from one counter shared with the race: the worker cancels by id, so ids never
    repeat within a process.
    """

    def __init__(self) -> None:
        self.info: ModelInfo | None = None  # the pair in use
        self.history: list[Message] = []  # user/assistant turns (the system prompt is added per request)
        self.records: list[AnswerRecord] = []  # every finished answer of the session, for export
        self.active_request: int | None = None  # the chat's answer streaming now
        self._in_flight: dict[int, _InFlight] = {}
        self._answers: list[int] = []  # request ids of the answers shown, oldest first
        self._detached: set[int] = set()  # requests whose chat was cleared while they streamed
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

    def can_regenerate(self) -> bool:
        return any(m.role == "user" for m in self.history)

    def messages_for(self, settings: GenerationSettings) -> tuple[Message, ...]:
        return system_messages(settings) + tuple(self.history)

    # --- what a person does ----------------------------------------------------------------------

    def send(self, text: str, settings: GenerationSettings) -> GenerationRequest:
        """Adds a user turn; returns the request for its answer."""
        self.history.append(Message("user", text))
        return self._start(settings)

    def regenerate(self, settings: GenerationSettings) -> tuple[GenerationRequest, int | None] | None:
        """Asks the last user turn again: (the new request, the answer it replaces or None); None if
        there is no user turn."""
        last_user = next((i for i in range(len(self.history) - 1, -1, -1) if self.history[i].role == "user"), None)
        if last_user is None:
            return None
        del self.history[last_user + 1 :]
        replaced = self._answers.pop() if self._answers else None
        return self._start(settings), replaced

    def new_chat(self) -> int | None:
        """Forgets the turns; returns the request still streaming (its answer belongs to the old chat)."""
        streaming = self.active_request
        if streaming is not None:
            self._detached.add(streaming)
        self.history.clear()
        self._answers.clear()
        return streaming

    def _start(self, settings: GenerationSettings) -> GenerationRequest:
        rid = self.allocate_request_id()
        request = build_request(settings, self.messages_for(settings), rid)
        self._in_flight[rid] = _InFlight(request, self.info)
        self._answers.append(rid)
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
        """Records a finished answer (and makes it a turn of the chat); None if it is not ours."""
        entry = self._in_flight.pop(request_id, None)
        if entry is None:
            return None
        if summary.text and request_id == self.active_request and request_id not in self._detached:
            self.history.append(Message("assistant", summary.text))
        record = AnswerRecord(entry.request, summary, entry.info, now_iso(), tuple(entry.steps))
        self.records.append(record)
        self._end(request_id)
        return record

    def fail(self, request_id: int) -> bool:
        if self._in_flight.pop(request_id, None) is None:
            return False
        self._end(request_id)
        return True

    def _end(self, request_id: int) -> None:
        self._detached.discard(request_id)
        if request_id == self.active_request:
            self.active_request = None
