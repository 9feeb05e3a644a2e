"""The one experiment core of the bench, the race and the sweep: prompt record and reader, timed runs, comparisons.

One prompt record (BenchPrompt) and one reader (parse_prompts) for prompt files and the packaged
prompts; one timed-run record (RunRecord) built from an engine generation; one identical-output
check (first_difference); one speedup; one schedule that warms every prompt before timing it and
rotates the order of the configurations per prompt and repeat, so no configuration pays the
first-run cost of a prompt (50-60 ms measured on an H200) for another; and the aggregates the
three report (totals, per category, median and spread over repeats).
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import InputError
from engine.limits import K_MAX
from engine.measure.costmodel import costs_at, expected_tokens, tree_costs_at
from engine.measure.stats import drafted_depth

if TYPE_CHECKING:  # torch and transformers wait until something really runs
    from engine.decoding import Generation
    from engine.types import ModelInfo, Step


@dataclass(frozen=True)
class BenchPrompt:
    id: str  # the prompt's id from the file (line number when absent)
    category: str  # free-form group, e.g. "code", "chat"
    prompt: str  # the user message


def parse_prompts(lines: Iterable[str], source: str) -> list[BenchPrompt]:
    """JSON lines {"id", "category", "prompt"}; any problem is an InputError naming the source and line."""
    prompts = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise InputError(f"{source}:{n}: not valid JSON ({getattr(e, 'msg', e)})") from None
        except RecursionError:
            raise InputError(f"{source}:{n}: not a prompt record (nested too deeply)") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise InputError(f'{source}:{n}: each line needs a non-empty "prompt" string')
        prompt = BenchPrompt(_field(row.get("id", f"line{n}")), _field(row.get("category", "")), row["prompt"])
        for value in (prompt.id, prompt.category, prompt.prompt):
            if not _is_text(value):
                raise InputError(f"{source}:{n}: not valid UTF-8 text (a \\ud800-style escape of half a character)")
        if prompt.id in seen:
            raise InputError(f"{source}:{n}: prompt id {prompt.id!r} appears twice; ids must be unique")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise InputError(f"prompts file {source} has no prompts")
    return prompts


def _field(value: object) -> str:
    # Ids and categories are labels: numbers are welcome, nested structures are not worth a traceback.
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)[:200]


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_prompts(path: Path) -> list[BenchPrompt]:
    """A JSONL prompts file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise InputError(f"cannot read prompts file {path}: {reason}") from None
    return parse_prompts(lines, str(path))


def packaged_prompts(name: str = "bench_prompts.jsonl") -> tuple[BenchPrompt, ...]:
    """assets/bench_prompts.jsonl (a packaged copy of the benchmark prompts), in file order."""
    text = resources.files("assets").joinpath(name).read_text(encoding="utf-8")
    return tuple(parse_prompts(text.splitlines(), f"assets/{name}"))


@dataclass(frozen=True)
class RunRecord:
    """One timed generation of one prompt in one configuration."""

    prompt_id: str  # BenchPrompt.id
    category: str  # BenchPrompt.category
    mode: str  # the configuration's label (a bench mode, or a sweep configuration such as "draft K=3 T=0")
    new_tokens: int  # tokens generated
    seconds: float  # wall time, prefill included
    tokens_per_s: float  # new_tokens / seconds
    target_forwards: int  # target forwards after prefill
    draft_forwards: int  # draft forwards after prefill (0 without a draft)
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens accepted
    text: str  # generated text
    token_ids: tuple[int, ...] = field(repr=False)  # generated ids, for exactness comparisons
    # Engine modes: the rounds' own time (CUDA: device time between each round's events; CPU: the
    # compute). seconds - round_seconds is what the loop spends outside its rounds (prefill,
    # host work the device waits for); 0 for the hf-* modes, which are not split into rounds.
    round_seconds: float = 0.0
    repeat: int = 0  # 0-based repeat index (--repeat)
    prefill_s: float = 0.0  # time split (engine modes): the prompt into the caches
    draft_s: float = 0.0  # drafting
    verify_s: float = 0.0  # target forwards and acceptance
    overhead_s: float = 0.0  # the rest of `seconds`
    k_mean: float = 0.0  # mean K asked for per step
    standard_steps: int = 0  # steps the controller made standard (K = 0)
    position_reached: tuple[int, ...] = ()  # per draft position: steps that reached it
    position_accepted: tuple[int, ...] = ()  # per draft position: steps that accepted it
    drafted_steps: tuple[int, ...] = ()  # index n: steps that drafted n tokens (0..K_MAX)
    drafted_by: tuple[tuple[str, int, int], ...] = ()  # (proposer, steps it drafted, tokens it drafted)
    # The draft model's wide first forwards: after a fully accepted draft it feeds its last draft token
    # and the bonus token (w = 2); after steps it did not draft, everything they committed (a catch-up).
    catch_up_widths: tuple[int, ...] = ()  # index w: draft proposals whose first forward was w tokens wide (w >= 2)
    # Trees of drafts (engine/runners/tree.py): per draft position, steps that rejected the draft
    # there and kept one of the alternatives beside it (one token more from the same forward).
    position_alternative: tuple[int, ...] = ()
    tree: int = 0  # alternatives beside each head draft token (0: chains)
    tree_nodes: int = 0  # nodes of the dynamic trees the head drafted (0: none)
    temperature: float = 0.0  # the request's sampling temperature (0 = greedy): which measured costs price the run


def record_run(generation: Generation, steps: Sequence[Step], prompt: BenchPrompt, label: str,
               repeat: int = 0) -> RunRecord:
    """The record of a finished engine generation and its steps."""
    s = generation.summary
    assert s is not None, "a finished generation has a summary"
    reached, hits, lengths, alternative = [0] * K_MAX, [0] * K_MAX, [0] * (K_MAX + 1), [0] * K_MAX
    by_source: dict[str, list[int]] = {}
    catch_ups = [0] * (K_MAX + 2)
    # Tokens the draft model feeds first next time (DraftModelProposer.pending). Before its first
    # proposal that is the prompt and what was committed since, fed as a prefill (booked as prefill,
    # Proposer.prepare) but the last token: its first forward is one token wide.
    pending = 1
    drafted_yet = False
    for step in steps:
        n = len(step.proposed)
        lengths[min(n, K_MAX)] += 1
        if n:
            counts = by_source.setdefault(step.sources[0], [0, 0])
            counts[0] += 1
            counts[1] += n
        if n and step.sources[0] == "draft":
            if drafted_yet and pending >= 2:
                catch_ups[min(pending, K_MAX + 1)] += 1
            drafted_yet = True
            pending = 2 if step.accepted == n else 1
        else:
            pending += step.new_tokens
        # position i reached when all before it were accepted (a tree's branch that ended there included)
        for i in range(min(drafted_depth(step) if n else 0, step.accepted + 1, K_MAX)):
            reached[i] += 1
            hits[i] += i < step.accepted
        if step.extra is not None and step.accepted < K_MAX:
            alternative[step.accepted] += 1
    return RunRecord(
        prompt_id=prompt.id, category=prompt.category, mode=label, new_tokens=s.new_tokens,
        seconds=s.seconds, tokens_per_s=s.tokens_per_s, target_forwards=s.target_forwards,
        draft_forwards=s.draft_forwards, drafted=s.drafted, accepted=s.accepted, text=s.text,
        token_ids=tuple(committed_ids(steps)), round_seconds=s.draft_s + s.verify_s, repeat=repeat,
        prefill_s=s.prefill_s, draft_s=s.draft_s, verify_s=s.verify_s, overhead_s=s.overhead_s,
        k_mean=s.k_mean, standard_steps=s.standard_steps, position_reached=tuple(reached),
        position_accepted=tuple(hits), drafted_steps=tuple(lengths),
        drafted_by=tuple((src, n, tokens) for src, (n, tokens) in by_source.items()),
        catch_up_widths=tuple(catch_ups) if any(catch_ups) else (),
        position_alternative=tuple(alternative) if any(alternative) else (),
        temperature=generation.request.sampling.temperature,
        tree=getattr(generation, "tree_alternatives", 0),
        tree_nodes=getattr(generation, "tree_nodes", 0),
    )


# --------------------------------------------------------------------------- comparing

def committed_ids(steps: Iterable[Step]) -> list[int]:
    """The token ids a generation committed, from its steps: kept drafts, then the target's own token."""
    ids: list[int] = []
    for s in steps:
        ids.extend(s.proposed[: s.accepted])
        if s.added is not None:
            ids.append(s.added)
        if s.extra is not None:
            ids.append(s.extra)
    return ids


def speedup(base_tokens_per_s: float, tokens_per_s: float) -> float:
    """What each configuration achieves alone, divided: NaN when the base produced nothing."""
    return tokens_per_s / base_tokens_per_s if base_tokens_per_s > 0 else math.nan


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """None when the token sequences are identical, else the first index where they differ
    (the shorter one's length when one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------- scheduling

@dataclass(frozen=True)
class Task:
    """One timed run to do: a prompt in a configuration, in one repeat."""

    prompt: BenchPrompt
    label: str  # the configuration
    repeat: int


def schedule(prompts: Sequence[BenchPrompt], labels: Sequence[str], repeats: int = 1) -> list[Task]:
    """Prompt by prompt, every configuration, the order rotated per prompt and repeat: slow drift
    (clocks, heat, a neighbour's load) and first-run costs spread over every configuration alike."""
    tasks = []
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            shift = (i + r) % len(labels)
            tasks.extend(Task(prompt, label, r) for label in (*labels[shift:], *labels[:shift]))
    return tasks


Runner = Callable[[Task], RunRecord]
Progress = Callable[[int, int, str], None]  # (done, total, what just ran)


def run_tasks(tasks: Sequence[Task], run: Runner, *, warm: Callable[[BenchPrompt], None] | None = None,
              progress: Progress | None = None, on_error: Callable[[Task, Exception], bool] | None = None
              ) -> list[RunRecord]:
    """Runs every task; `warm(prompt)` (untimed) before the first task of each prompt in each repeat.

    `on_error(task, exc)` returns True to record and go on (a failing baseline), False to raise.
    """
    records: list[RunRecord] = []
    warmed: set[tuple[str, int]] = set()
    for done, task in enumerate(tasks, 1):
        if warm is not None and (task.prompt.id, task.repeat) not in warmed:
            warm(task.prompt)
            warmed.add((task.prompt.id, task.repeat))
        try:
            records.append(run(task))
        except Exception as exc:
            if on_error is None or not on_error(task, exc):
                raise
        if progress is not None:
            progress(done, len(tasks), f"{task.prompt.id} {task.label}")
    return records


# --------------------------------------------------------------------------- aggregates

def round_split(runs: Sequence[RunRecord]) -> dict[str, float]:
    """Ms per step of the runs' decoding (after the prompt's prefill), speculative or standard: the drafting
    and the verify as the device's events timed them, the host's work between steps (their overhead), and the
    time outside every step (the answer's start and end): what a round spent, beside what the cost model
    priced it at (ModelInfo's costs at load). A proposer that drafts every round (the head at a fixed K) gives
    its rounds' figures; one that often has nothing to draft (n-gram lookup) their mean with standard steps."""
    rounds = sum(sum(r.drafted_steps) for r in runs) or 1
    parts = {"draft": sum(r.draft_s for r in runs), "verify": sum(r.verify_s for r in runs),
             "host": sum(r.overhead_s for r in runs)}
    parts["outside"] = sum(r.seconds - r.prefill_s for r in runs) - sum(parts.values())
    parts["all"] = sum(parts.values())
    return {name: 1e3 * v / rounds for name, v in parts.items()}


def totals(runs: Sequence[RunRecord]) -> dict[str, Any]:
    """Sums over runs: tok/s is total tokens over total seconds (long answers weigh more, as in use)."""
    tokens, seconds = sum(r.new_tokens for r in runs), sum(r.seconds for r in runs)
    drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
    forwards = sum(r.target_forwards for r in runs)
    rounds = sum(r.round_seconds for r in runs)
    split = {name: sum(getattr(r, name) for r in runs) for name in ("prefill_s", "draft_s", "verify_s", "overhead_s")}
    steps = forwards
    return {
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_target_forward": tokens / forwards if forwards else 0.0,
        "new_tokens": tokens,
        "seconds": seconds,
        # Share of the wall time spent inside rounds (engine modes only; None for hf-*).
        "in_rounds": rounds / seconds if rounds and seconds > 0 else None,
        # The time split: shares of `seconds` (engine modes; zeros for hf-*).
        "time_split": {name.removesuffix("_s"): (v / seconds if seconds > 0 else 0.0) for name, v in split.items()},
        "k_mean": sum(r.k_mean * r.target_forwards for r in runs) / steps if steps else 0.0,
        "standard_steps": sum(r.standard_steps for r in runs),
        "per_position_acceptance": position_acceptance(runs),
        "runs": len(runs),
    }


def position_acceptance(runs: Sequence[RunRecord]) -> tuple[float, ...]:
    """P(accepted | reached) per draft position over all runs (positions never reached are left off)."""
    reached = [sum(r.position_reached[i] for r in runs if r.position_reached) for i in range(K_MAX)]
    hits = [sum(r.position_accepted[i] for r in runs if r.position_accepted) for i in range(K_MAX)]
    out = [h / n for h, n in zip(hits, reached) if n]
    return tuple(out)


def alternative_rates(runs: Sequence[RunRecord]) -> tuple[float, ...]:
    """Per draft position: the share of rejections there at which the target picked one of the
    tree's alternatives (runs that drafted trees; empty without any)."""
    trees = [r for r in runs if r.tree and r.position_alternative]
    if not trees:
        return ()
    out = []
    for i in range(K_MAX):
        rejected = sum(r.position_reached[i] - r.position_accepted[i] for r in trees if r.position_reached)
        kept = sum(r.position_alternative[i] for r in trees)
        out.append(kept / rejected if rejected else 0.0)
    return tuple(out)


def alternative_tokens(per_position: Sequence[float], rescue: Sequence[float], k: int) -> float:
    """Expected tokens a K-draft tree adds to its chain: at the first rejection (position i, reached
    with prob prod a_<i) an alternative kept with prob rescue_i gives one token more."""
    total, reach = 0.0, 1.0
    for i in range(k):
        a = per_position[i] if i < len(per_position) else (per_position[-1] if per_position else 0.0)
        h = rescue[i] if i < len(rescue) else 0.0
        total += reach * (1 - a) * h
        reach *= a
    return total


def predicted_speedup(info: ModelInfo, runs: Sequence[RunRecord], standard_runs: Sequence[RunRecord]) -> float | None:
    """What the cost model predicts these runs gain over the standard runs of the same prompts.

    From the costs measured at load (every verify width, each proposer's own cost; those of sampled
    rounds for runs at temperature > 0, costmodel.costs_at) and, measured in these very runs, the
    acceptance per draft position, the draft lengths and proposers used, and the per-step overhead
    outside the forwards (which the textbook formula leaves out: on an H200 it put measured speedups
    3-10% under the prediction). A draft model's
    first forward of a proposal when it is w >= 2 tokens wide (after a fully accepted draft: its last
    draft token and the bonus token; after steps it did not draft: what they committed) is costed
    like a target forward of that width, scaled to the draft: on llama.cpp's CPU kernels a 2-token
    forward costs 1.8x a 1-token one for both models, on CUDA graphs about 1x. The draft's prompt
    prefill (deferred to its first proposal) is in the runs' measured prefill. None without costs.
    """
    steps = sum(r.target_forwards for r in runs)
    std_steps = sum(r.target_forwards for r in standard_runs)
    if not info.target_ms or not steps or not std_steps:
        return None
    per_position = position_acceptance(runs) or (0.0,)
    rescue = alternative_rates(runs)
    tokens, seconds = 0.0, 0.0
    for r in runs:
        target, costs = costs_at(info, r.temperature > 0)
        tree_ms = tree_costs_at(info, r.temperature > 0)
        lengths = r.drafted_steps
        tree = r.tree and r.tree == info.tree_alternatives
        grown = r.tree_nodes and r.tree_nodes == info.tree_nodes  # a dynamic tree: its path is the draft
        tree_draft = dict(info.tree_draft_ms) if grown else {}  # ... and its drafting costs its own
        for n, count in enumerate(lengths):
            if not count:
                continue
            if grown and n in tree_ms:  # the tree's verify; what it keeps is in the per-position acceptance
                tokens += count * expected_tokens(per_position, n)
                seconds += count * (tree_ms[n] + tree_draft.get(n, 0.0)) / 1000
            elif tree and n in tree_ms:  # verified as a tree: its own verify cost, and the alternatives' tokens
                tokens += count * (expected_tokens(per_position, n) + alternative_tokens(per_position, rescue, n))
                seconds += count * tree_ms[n] / 1000
            else:
                tokens += count * expected_tokens(per_position, n)
                seconds += count * target[n + 1] / 1000
        for source, n_steps, n_tokens in r.drafted_by:
            if source == "head" and tree_draft:  # its rounds were trees, priced above (K <= TREE_K_MAX, all measured)
                continue
            cost = costs.get(source)
            if cost is None:
                return None
            seconds += (n_steps * cost.per_proposal_ms + n_tokens * cost.per_token_ms) / 1000
        draft = costs.get("draft")
        for width, count in enumerate(r.catch_up_widths):
            if count and draft is not None:  # a w-token draft forward, costed like the target's widths
                seconds += count * draft.per_token_ms * (target[width] / target[1] - 1) / 1000
        seconds += r.prefill_s + r.overhead_s
    std_seconds = sum(r.prefill_s + r.overhead_s + r.target_forwards * costs_at(info, r.temperature > 0)[0][1] / 1000
                      for r in standard_runs)
    std_tokens = sum(r.new_tokens for r in standard_runs)
    return speedup(std_tokens / std_seconds, tokens / seconds)


def spread(runs: Sequence[RunRecord], label: str) -> dict[str, float] | None:
    """Median, min and max of one configuration's tok/s over repeats (each repeat's total); None for one repeat."""
    by_repeat: dict[int, list[RunRecord]] = {}
    for r in runs:
        if r.mode == label:
            by_repeat.setdefault(r.repeat, []).append(r)
    if len(by_repeat) < 2:
        return None
    rates = [totals(rs)["tokens_per_s"] for rs in by_repeat.values()]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "repeats": len(rates)}


def by_category(runs: Sequence[RunRecord], labels: Sequence[str], base: str = "standard") -> dict[str, dict[str, Any]]:
    """Per category: each configuration's tok/s and its speedup over `base` in that category."""
    out: dict[str, dict[str, Any]] = {}
    for category in dict.fromkeys(r.category for r in runs):
        rows = [r for r in runs if r.category == category]
        rates = {label: totals([r for r in rows if r.mode == label])["tokens_per_s"] for label in labels}
        entry: dict[str, Any] = {"tokens_per_s": rates}
        if base in rates:
            entry["vs_" + base] = {label: speedup(rates[base], v) for label, v in rates.items() if label != base}
        out[category] = entry
    return out
