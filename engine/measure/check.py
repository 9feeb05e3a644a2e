"""Will this draft pay? Every proposer ranked by its predicted speedup, from one look at the target's own continuations.

For probe prompts in the bench prompts' mix of categories (assets/check_prompts.jsonl, never the bench prompts) the
target's greedy continuation is decoded. With a draft head attached it goes through the engine's own
loop with the head (lossless, so the target's own text; those rounds are the head's check too), and
the target's logits row before each continuation token then comes from a teacher-forced forward over
the continuation, from the prompt the decoding left in the cache (on llama.cpp in chunks its reserved
logits buffer holds, K_MAX + 1 rows). Without one it is decoded as standard decoding does, one token a
forward, keeping each forward's row. Each draft model is teacher-forced on the same continuation and
compared row by row: top-1 agreement, KL(p || q), and 1 - TV after the asked sampling on both
(check_math.agreement). Positions beyond the first are chained over the continuation
(check_math.rounds: position i of a round starting at row t is judged at row t + i), which at T = 0
replays greedy speculative decoding exactly, since accepted drafts are the target's own tokens; it
was chosen over a fitted per-position decay because it keeps how acceptance clusters in real text (a
boilerplate line accepted whole, a name rejected) at no cost. N-gram lookup proposes from the same
continuations as it would while decoding. The draft head is judged on its own rounds of the
continuation's decoding, since its drafts read the target's hidden states of its own verify passes.
Speedups come from the forward costs the engine measured at load (engine/decoding/costs.py) through
the cost model's price of a round (costmodel.py).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from engine.decoding.ngram import NgramProposer
from engine.decoding.proposers import empty_proposal
from engine.decoding.sampling import process
from engine.errors import GenerationError
from engine.limits import K_MAX, PROBE_TOKENS, TREE_K_MAX
from engine.measure.check_load import DraftUnderTest, engine_draft, load_drafts, params_of
from engine.measure.check_math import Rounds, agreement, chained, kl_divergence, point_mass
from engine.measure.check_price import price_chain, price_head, price_ngram
from engine.measure.check_tally import Tally, merged, spread
from engine.measure.check_types import STOPPED, CandidateCheck, CheckReport
from engine.measure.experiment import BenchPrompt, packaged_prompts
from engine.runners import ids_tensor
from engine.types import GenerationRequest, Message, Sampling

log = logging.getLogger(__name__)

FORCED_ROWS = 64  # rows per teacher-forced forward: a 152k vocabulary's float32 logits, 39 MB
HEAD_K = TREE_K_MAX  # draft length of the head's own rounds (positions beyond it repeat the last rate)
# The head's rounds price the host's work beside their forwards only where MIN_TIMED_ROUNDS of them fit in TIMED_S:
# rounds of hundreds of ms, a CPU's, would price their forwards' noise (a load running 10-20% off its prices),
# not the host's work, which is lost in them. At T > 0 they are timed again sampling (verify.tree_choices walks
# siblings on the host, which a greedy round does not: on an H100 0.46 ms a round against 0.19), up to
# TIMED_TOKENS tokens of the first probe.
TIMED_TOKENS, TIMED_S, MIN_TIMED_ROUNDS = 96, 1.0, 16
POSITIONS = ("chained over the target's greedy continuation: draft position i of a round starting at row t is "
             "judged at row t + i (an exact replay at T = 0; at T > 0 the context is the greedy text)")
NGRAM_POSITIONS = "n-gram lookup's own proposals on the continuations, chained as drafts"
HEAD_POSITIONS = f"the head's own drafts through the decoding loop (greedy rounds of K = {HEAD_K})"
Progress = Callable[[float, str], None]


def probe_prompts() -> tuple[BenchPrompt, ...]:
    """The shipped probe prompts: two per category of the bench prompts, none of them a bench prompt."""
    return packaged_prompts("check_prompts.jsonl")


def run_check(engine, drafts: Sequence[DraftUnderTest], *, sampling: Sampling, head: bool = True,
              ngram: bool = True, refused: Sequence[CandidateCheck] = (), prompts: Sequence[BenchPrompt] | None = None,
              probe_tokens: int = PROBE_TOKENS, progress: Progress | None = None,
              cancel: threading.Event | None = None, answer_tokens: int | None = None) -> CheckReport:
    """Checks every loaded draft, the engine's head (when `head` and one is attached) and n-gram lookup; the
    speedups are those of answers of `answer_tokens` tokens where given (their last rounds keep only what is
    left: costmodel.answer_share), else of rounds."""
    started = time.perf_counter()
    prompts = tuple(prompts if prompts is not None else probe_prompts())
    with_head = head and engine.head_runner is not None
    # per candidate, a tally per probe: their sum prices it, their resamples give its ranges (check_tally.spread)
    tallies: dict[int, list[Tally]] = {id(d): [] for d in drafts}
    ngram_tallies: list[Tally] = []
    head_tallies: list[Tally] = []
    compared = 0
    # seconds per part, over the probes: the loop's decoding of the continuations (with the head when it is
    # checked), the target's teacher-forced rows, each draft model's rows, judging n-gram lookup and the head
    phases = {"continuation": 0.0, "target": 0.0, "ngram and head": 0.0}
    for n, prompt in enumerate(prompts):
        if cancel is not None and cancel.is_set():
            raise GenerationError(STOPPED)
        if progress is not None:
            progress(n / len(prompts), f"Probe {n + 1} of {len(prompts)}: the target's continuation")
        ids = engine.encode(GenerationRequest(messages=(Message("user", prompt.prompt),)))
        t0 = time.perf_counter()
        if with_head:
            cont, head_steps, cached = _continuation(engine, ids, prompt, probe_tokens)
            phases["continuation"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            rows = _target_rows(engine.target_runner, engine.vocab, ids, cont, cached)  # [N, V], a row per token
            phases["target"] += time.perf_counter() - t0
        else:  # standard decoding: its rows are the target's own, no second pass over the continuation
            cont, rows = _decode_rows(engine.target_runner, engine.vocab, ids, probe_tokens, engine.eos_ids)
            head_steps = []
            phases["continuation"] += time.perf_counter() - t0
        compared += len(cont)
        for d in drafts:
            t0 = time.perf_counter()
            tallies[id(d)].append(Tally.empty(K_MAX))
            _compare_draft(d, ids, rows, cont, sampling, tallies[id(d)][-1])
            phases[d.name] = phases.get(d.name, 0.0) + time.perf_counter() - t0
        t0 = time.perf_counter()
        if ngram:
            ngram_tallies.append(Tally.empty(K_MAX))
            _ngram(ids, rows, cont, sampling, ngram_tallies[-1])
        if with_head:
            head_tallies.append(Tally.empty(HEAD_K))
            _head(head_steps, rows, cont, sampling, head_tallies[-1])
        phases["ngram and head"] += time.perf_counter() - t0
    if with_head and prompts:
        t0 = time.perf_counter()
        _time_host_work(engine, prompts[0], sampling, head_tallies)
        if not sampling.greedy:
            phases["sampled rounds"] = time.perf_counter() - t0
    log.info("draft check phases (s): %s", {k: round(v, 1) for k, v in phases.items()})
    if progress is not None:
        progress(1.0, "Pricing the candidates")
    target_params = params_of(engine.target_runner, engine.target)
    priced: list[tuple[Callable[[Tally], CandidateCheck], list[Tally], int]] = [
        (lambda t, d=d: replace(price_chain(engine.info, d.name, d.params, target_params, d.cost, d.sampled_cost,
                                            t.summary(), sampling, POSITIONS, answer_tokens), spec=d.spec),
         tallies[id(d)], K_MAX)
        for d in drafts]
    if with_head:
        priced.append((lambda t: price_head(engine.info, engine.head_runner, target_params, t.summary(), t, sampling,
                                            HEAD_POSITIONS, answer_tokens), head_tallies, HEAD_K))
    if ngram:
        priced.append((lambda t: price_ngram(engine.info, t.summary(), sampling, NGRAM_POSITIONS), ngram_tallies,
                       K_MAX))
    results = [spread(price(merged(per_probe, k_max)), per_probe, price) for price, per_probe, k_max in priced]
    ranked = sorted(results, key=lambda c: -(c.speedup or 0.0)) + list(refused)
    target_ms = dict(engine.info.target_ms).get(1, 0.0)
    return CheckReport(engine.info.target_name, engine.info.runtime, engine.info.device, sampling.temperature,
                       sampling.top_p, sampling.top_k, len(prompts), compared, target_ms, tuple(ranked),
                       verdict_line(ranked), time.perf_counter() - started,
                       tuple((k, round(v, 2)) for k, v in phases.items()), answer_tokens)


def _continuation(engine, ids: list[int], prompt: BenchPrompt, n: int) -> tuple[list[int], list, bool]:
    """The target's greedy continuation of the probe (at most n tokens, up to an end token), decoded by the
    engine's loop with the draft head (greedy speculative decoding is lossless, so the target's own text),
    the head's rounds (K = HEAD_K) for judging it, and whether the target's cache still holds the prompt `ids`
    (all but its last token) for the teacher-forced rows to start from."""
    request = GenerationRequest(messages=(Message("user", prompt.prompt),), mode="speculative", proposer="head",
                                k=HEAD_K, max_new_tokens=n)
    cont: list[int] = []
    steps = []
    generation = engine.generate(request)
    try:
        for step in generation:
            cont += list(step.proposed[:step.accepted]) + [t for t in (step.added, step.extra) if t is not None]
            steps.append(step)
    finally:
        generation.close()  # the engine's lock is free for the teacher-forced rows at once
    # The loop leaves every committed token but the last in the cache, the prompt first.
    cached = engine.encode(request) == ids and engine.target_runner.length >= len(ids) - 1
    return cont[:n], steps, cached


def _time_host_work(engine, prompt: BenchPrompt, sampling: Sampling, tallies: list[Tally]) -> None:
    """What the head's rounds took, for pricing the host's work beside their forwards: nothing where the
    greedy rounds show that MIN_TIMED_ROUNDS do not fit in TIMED_S (the timing is cleared); at T > 0 their
    sampled wall time, the same mean for every probe's rounds."""
    timed = sum(t.rounds_timed for t in tallies)
    if not timed:
        return
    if sum(t.round_ms for t in tallies) / timed * MIN_TIMED_ROUNDS > TIMED_S * 1000.0:
        for t in tallies:
            t.round_ms, t.rounds_timed = 0.0, 0
        return
    sampled_ms = None if sampling.greedy else _sampled_round_ms(engine, prompt, sampling)
    if sampled_ms is not None:
        for t in tallies:
            t.round_ms = sampled_ms * t.rounds_timed


def _sampled_round_ms(engine, prompt: BenchPrompt, sampling: Sampling) -> float | None:
    """The mean wall time (drafting, verify, host work) of the head's rounds sampling at `sampling` on the
    probe, or None where fewer than MIN_TIMED_ROUNDS rounds fit in TIMED_S."""
    request = GenerationRequest(messages=(Message("user", prompt.prompt),), mode="speculative", proposer="head",
                                k=HEAD_K, max_new_tokens=TIMED_TOKENS, sampling=sampling)
    spent, rounds = 0.0, 0
    started = time.perf_counter()
    generation = engine.generate(request)
    try:
        for step in generation:
            if step.proposed:
                spent += step.draft_ms + step.verify_ms + step.overhead_ms
                rounds += 1
            if time.perf_counter() - started > TIMED_S:
                break
    finally:
        generation.close()
    return spent / rounds if rounds >= MIN_TIMED_ROUNDS else None


@torch.inference_mode()
def _decode_rows(runner, vocab: int, ids: list[int], n: int, eos: set[int]) -> tuple[list[int], torch.Tensor]:
    """The target's greedy continuation (at most n tokens, up to an end token) decoded one token a forward, as
    standard decoding does, with the logits row before each token [N, V] (float16 on the host). Without a head
    to judge there is nothing to gain from speculative rounds here, and this way the rows come for free: on
    a 2-core CPU a second, teacher-forced pass over the continuations took a third of the check."""
    runner.reset()
    if len(ids) > 1:
        runner.prefill(ids_tensor(ids[:-1], runner.device))
    cont: list[int] = []
    rows = []
    token = ids[-1]
    while len(cont) < n:
        logits = runner.forward(ids_tensor([token], runner.device))[0, :vocab]  # [V]
        rows.append(logits.to(torch.float16).cpu())  # a copy: llama.cpp's buffer is reused by the next call
        token = int(logits.argmax())
        cont.append(token)
        if token in eos:
            break
    runner.reset()
    return cont, torch.stack(rows).float()


def _forced(runner, vocab: int, ids: list[int], cont: list[int], cached: bool = False):
    """Teacher-forces `cont` after the prompt `ids`: yields (offset into cont, logits rows [W, :vocab]), the
    row before each token of cont. The prompt is prefilled unless `cached` (the cache already holds all but
    its last token). Forwards of FORCED_ROWS rows, a default continuation in one (on two CPU cores a 40-row
    forward cost 0.27 s against 0.69 s in chunks of 13), or of what the runner can return (llama.cpp's
    logits buffer: `max_rows`). The runner is reset afterwards."""
    if cached:
        runner.rollback(len(ids) - 1)
    else:
        runner.reset()
        if len(ids) > 1:
            runner.prefill(ids_tensor(ids[:-1], runner.device))
    inputs = [ids[-1]] + cont[:-1]
    width = min(getattr(runner, "max_rows", None) or FORCED_ROWS, FORCED_ROWS)
    try:
        for start in range(0, len(inputs), width):
            yield start, runner.forward(ids_tensor(inputs[start:start + width], runner.device))[:, :vocab]
    finally:
        runner.reset()


@torch.inference_mode()
def _target_rows(runner, vocab: int, ids: list[int], cont: list[int], cached: bool = False) -> torch.Tensor:
    """The target's logits row before each token of `cont` [N, V] (float16 on the host: the probes' rows of a
    152k vocabulary fit)."""
    # .to(float16).cpu() copies: llama.cpp's buffer is reused by the next call
    return torch.cat([out.to(torch.float16).cpu() for _, out in _forced(runner, vocab, ids, cont, cached)]).float()


@torch.inference_mode()
def _compare_draft(draft: DraftUnderTest, ids: list[int], rows: torch.Tensor, cont: list[int], sampling: Sampling,
                   tally: Tally) -> None:
    """The draft teacher-forced on the continuation: its row before each continuation token against the target's."""
    vocab = min(draft.vocab, rows.shape[-1])
    greedy_hits, sampled = [], []
    for start, out in _forced(draft.runner, vocab, ids, cont):
        q = out.float().cpu()  # [W, V]
        p = rows[start:start + len(q), :vocab]  # [W, V]
        greedy_hits += (q.argmax(-1) == torch.tensor(cont[start:start + len(q)])).float().tolist()
        sampled += agreement(p, q, sampling).tolist() if not sampling.greedy else []
        tally.kl_sum += float(kl_divergence(p, q).sum())
    tally.top1_sum += sum(greedy_hits)
    tally.rows += len(greedy_hits)
    tally.add_offers(chained(greedy_hits, K_MAX), chained(sampled or greedy_hits, K_MAX))


def _ngram(ids: list[int], rows: torch.Tensor, cont: list[int], sampling: Sampling, tally: Tally) -> None:
    """N-gram lookup's proposal at every row of the continuation, judged as point masses."""
    lookup, nothing = NgramProposer(), empty_proposal(torch.device("cpu"))
    lookup.start(ids)
    greedy, sampled = [], []
    for t in range(len(cont)):
        x = lookup.match(min(K_MAX, len(cont) - t))[0]
        truth = cont[t:t + len(x)]
        greedy.append([float(a == b) for a, b in zip(x, truth)])
        if x and not sampling.greedy:
            sampled.append(point_mass(rows[t:t + len(x)], torch.tensor(x), sampling).tolist())
        else:
            sampled.append(greedy[-1])
        lookup.commit(nothing, 0, [cont[t]])  # the committed token, one at a time (every row may start a round)
    hits = [g[0] for g in greedy if g]
    tally.top1_sum += sum(hits)
    tally.rows += len(hits)
    tally.add_offers(greedy, sampled)


def _head(steps: list, rows: torch.Tensor, cont: list[int], sampling: Sampling, tally: Tally) -> None:
    """The head's greedy rounds of HEAD_K drafts that decoded the continuation; at T > 0 each reached draft is
    judged by the processed target probability of its token at that row (point-mass drafts, as the head's),
    and where the round walked a tree by the sum of that probability over every token drafted at that position
    under the path (Step.tree_children): sampling through a tree accepts one of a node's children with
    probability sum_i p(x_i) (verify.tree_choices), more than its first choice alone. The rows are the greedy
    text's, so past a sibling that sampling would take, the path's own children stand for the branch's.

    A round reaches draft position i when it accepted the i before it, up to its chain's length or its tree's
    depth. In a dynamic tree a walk can end where its branch has no child left (a small tree spends its nodes
    on the first levels): that position counts as reached and not accepted, as a rejection does, so the
    product of the positions' rates is what a round keeps (counting only positions with a draft shown would
    credit every short branch as accepted to its end)."""
    reached, accepted, sampled = [0.0] * HEAD_K, [0.0] * HEAD_K, [0.0] * HEAD_K
    rejected, rescued = [0.0] * HEAD_K, [0.0] * HEAD_K
    for step in steps:
        start = step.total_tokens - step.new_tokens
        depth = step.tree_depth or len(step.proposed)
        for i in range(min(step.accepted + 1, depth, HEAD_K)):
            if start + i >= len(cont):
                break
            reached[i] += 1
            accepted[i] += i < step.accepted
            if sampling.greedy or i >= len(step.proposed):  # no draft shown there: a branch that ended
                sampled[i] += float(i < step.accepted)
            else:
                drafted = step.tree_children[i] if i < len(step.tree_children) else (step.proposed[i],)
                law = process(rows[start + i:start + i + 1].float(), sampling)[0]  # [V] once, however many drafted
                sampled[i] += min(1.0, float(law[torch.tensor(drafted)].sum()))
        if step.accepted < len(step.proposed) and step.accepted < HEAD_K and start + step.accepted < len(cont):
            rejected[step.accepted] += 1
            rescued[step.accepted] += step.extra is not None
        if step.proposed:  # what the round took, host work included (the price at load counts its forwards only)
            tally.round_ms += step.draft_ms + step.verify_ms + step.overhead_ms
            tally.rounds_timed += 1
    tally.greedy[HEAD_K] = tally.greedy[HEAD_K] + Rounds(tuple(reached), tuple(accepted), 0.0, 0.0, 0.0)
    tally.sampled[HEAD_K] = tally.sampled[HEAD_K] + Rounds(tuple(reached), tuple(sampled), 0.0, 0.0, 0.0)
    tally.top1_sum += accepted[0]
    tally.rows += int(reached[0])
    tally.rejected = [a + b for a, b in zip(tally.rejected or [0.0] * HEAD_K, rejected)]
    tally.rescued = [a + b for a, b in zip(tally.rescued or [0.0] * HEAD_K, rescued)]


def verdict_line(ranked: Sequence[CandidateCheck]) -> str:
    """'the head: 1.9x here; the 0.5B draft: 0.86x, it costs 63% of a target forward; n-gram: 1.1x'."""
    parts = []
    for c in ranked:
        if c.status != "ok" or c.speedup is None:
            continue
        label = {"head": "the head", "ngram": "n-gram"}.get(c.kind) or (
            f"the {_size(c.params)} draft" if c.params >= 1e8 else f"the draft {c.name}".replace("draft draft", "draft"))
        part = f"{label}: {c.speedup:.2f}× here" + (f" (K={c.best_k}{', tree' if c.tree else ''})" if c.best_k else "")
        if c.speedup <= 1.0 and c.cost_ratio is not None and c.kind != "ngram":
            part += f", it costs {c.cost_ratio:.0%} of a target forward"
        parts.append(part)
    if not parts:
        return "No candidate could be checked."
    best = next((c for c in ranked if c.speedup is not None and c.speedup > 1.0), None)
    tail = "" if best is not None else " — none pays here: stay with standard decoding."
    return "; ".join(parts) + tail


def _size(params: int) -> str:
    return f"{params / 1e9:.1f}B"


def check_engine(engine, target_spec: str | None, draft_specs: Sequence[str], *, sampling: Sampling,
                 head: bool = True, ngram: bool = True, prompts: Sequence[BenchPrompt] | None = None,
                 probe_tokens: int = PROBE_TOKENS, progress: Progress | None = None,
                 cancel: threading.Event | None = None, load_torch=None,
                 answer_tokens: int | None = None) -> CheckReport:
    """The whole check on a loaded engine: its own draft (if any), each of `draft_specs` besides it (tokenizer
    first, then loaded on the engine's runtime: check_load.load_drafts), its head and n-gram lookup.
    The report's wall time counts from here: the extra drafts' loads are in it."""
    started = time.perf_counter()
    own = engine_draft(engine)
    extra = list(dict.fromkeys(draft_specs))

    def loading(fraction: float, message: str) -> None:
        if progress is not None:
            progress(0.1 * fraction, message)

    drafts, refusals = load_drafts(engine, target_spec, extra, loading, load_torch) if extra else ([], [])
    drafts = ([own] if own is not None else []) + drafts
    if head and engine.head_runner is None:
        refusals.append(CandidateCheck(name="draft head", kind="head", status="refused", reason=_no_head(engine)))

    def checking(fraction: float, message: str) -> None:
        if progress is not None:
            progress(0.1 + 0.9 * fraction, message)

    report = run_check(engine, drafts, sampling=sampling, head=head, ngram=ngram, refused=refusals, prompts=prompts,
                       probe_tokens=probe_tokens, progress=checking, cancel=cancel, answer_tokens=answer_tokens)
    return replace(report, wall_s=time.perf_counter() - started)


def _no_head(engine) -> str:
    if engine.target is None:
        return (f"A draft head reads the target's hidden states, which the {engine.info.runtime} runtime does not "
                "give: run the check with --runtime torch to include it.")
    return ("No draft head is loaded for this target: train one with `specdec-studio distill --target ... --out DIR` "
            "and check it with --head DIR.")
