"""The distillation's data phase: rounds of questions the target writes as a user, and its answers.

A mixin of Distiller (engine/heads/distill.py), which supplies target, tokenizer, plan, work, clock,
state, refusals, extra_questions, cancel, device, the rounds kept from earlier runs (_kept_rounds) and the
logging and budget methods; TrainingPhase
(fitting.py) is its other half.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from pathlib import Path

import torch

from engine.heads import data as D
from engine.heads.fitting import answer_tokens, load_round
from engine.heads.generate import ContinuousSampler, NonFiniteLogits
from engine.runners.lean import UnsupportedModelError

log = logging.getLogger(__name__)


class DataPhase:
    """Writing data rounds (see the module's docstring for what the Distiller supplies)."""

    def _generate_time(self, share: float = 1.0) -> float:
        """Seconds one generate call may take: `share` of what is left of the data phase and of this call.

        A slow machine then cuts a round short (shorter answers, fewer finished questions) instead
        of eating the training's time.
        """
        left = min(self._data_until - self.clock.used(), self.clock.call_left() - self.plan.reserve_s - 5.0)
        return max(share * left, 5.0)

    def _rounds(self) -> list[Path]:
        return sorted((self.work / "data").glob("round-*.pt"))

    def _make_sampler(self) -> ContinuousSampler | None:
        """Continuous batching over the lean decoder for the data phase (None: Hugging Face's generate)."""
        plan = self.plan
        if plan.rows <= 0:
            return None
        longest = plan.question_tokens + plan.answer_tokens + 384  # a question, its answer, template and system
        if plan.followup_share > 0:
            longest += plan.question_tokens + plan.answer_tokens
        longest = min(longest, getattr(self.target.config, "max_position_embeddings", longest))
        try:
            return ContinuousSampler(self.target, rows=plan.rows, max_length=longest,
                                     eos=D.eos_ids(self.tokenizer, self.target))
        except UnsupportedModelError as e:
            log.warning("data by Hugging Face's generate: %s", e)
            return None

    def _write(self, prompts: list[list[int]], *, segment: int = 0, **options) -> list[tuple[list[int], bool]]:
        """The target's continuations of prompts: by continuous batching, or by Hugging Face's generate (in
        `segment`-token segments) without a sampler or once the sampler's logits were not finite."""
        if self.sampler is not None:
            try:
                return self.sampler.run(prompts, **options)
            except NonFiniteLogits as e:
                self._log({"kind": "writer", "writer": "generate", "reason": str(e)}, "data",
                          f"{e} Writing the rest of the data with Hugging Face's generate.")
                log.warning("%s Writing the rest of the data with Hugging Face's generate.", e)
                self.sampler = None
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        return D.sample_segmented(self.target, self.tokenizer, prompts, segment=segment, **options)

    def _data(self, until: float) -> bool:
        """Writes data rounds until the budget reaches `until` seconds; True once the data is done (the budget
        or max_rounds reached), False where the call ends or is cancelled first (the next call writes on)."""
        self.sampler = self._make_sampler()
        try:
            return self._data_rounds(until)
        finally:
            self.sampler = None  # its cache goes before training needs the memory
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _data_rounds(self, until: float) -> bool:
        plan = self.plan
        self._data_until = until
        seen = set()
        for path in self._rounds() + self._kept_rounds():  # kept rounds' questions too: held-out answers stay unseen
            seen.update(D.dedupe_key(r["question"]) for r in load_round(path))
        last = 0.0  # seconds the last round took: a round is not started if it would overrun
        while True:
            r = self.state["rounds"]
            if plan.max_rounds is not None and r >= plan.max_rounds:
                return True
            if r > 0 and self.clock.used() >= until - last:
                return not self.cancel.is_set()  # another round would overrun the data's share of the budget
            if r > 0 and (self.cancel.is_set() or self.clock.call_left() - last <= plan.reserve_s):
                return False  # the call ends (or cancel) before the data is done: the next call writes on
            self._report("data", f"data round {r + 1}: sampling questions")
            started = time.perf_counter()
            seed = self.data_seed * 1000003 + r  # this round's draws
            rng = torch.Generator().manual_seed(seed)
            questions, stats = self._questions(r, rng, seen)
            # Round 0 is greedy (held-out acceptance is measured on greedy answers), then by share.
            greedy = int((r + 1) * plan.sampled_share) == int(r * plan.sampled_share)
            self._report("data", f"data round {r + 1}: answering {len(questions)} questions "
                                 f"({'greedy' if greedy else 'sampled'})")
            records = self._answers(questions, greedy, rng, seed=seed)
            if plan.followup_share > 0 and records:
                more, follow = self._followups(records, greedy, rng, seen, seed=seed + 500009)
                records += more
                stats = {**stats, "followups": follow}
            tmp = self.work / "data" / f".round-{r:05d}.pt.tmp"
            torch.save(records, tmp)
            os.replace(tmp, self.work / "data" / f"round-{r:05d}.pt")
            self.state["rounds"] = r + 1
            self._save_state()
            tokens = answer_tokens(records)
            last = time.perf_counter() - started
            self._log({"kind": "data", "round": r + 1, "seed": self.data_seed, **stats, "answers": len(records),
                       "answer_tokens": tokens,
                       "greedy": greedy, "seconds": round(last, 1),
                       "answer_tokens_per_s": round(tokens / max(last, 1e-9)),
                       "writer": "continuous" if self.sampler is not None else "generate"},
                      "data", f"data round {r + 1}: {len(records)} answers, {tokens} tokens")

    def _questions(self, r: int, rng: torch.Generator, seen: set[str]) -> tuple[list[tuple[str, str]], dict]:
        """(category, question) pairs for round r: sampled user turns, filtered, deduplicated, not refused."""
        plan, tok = self.plan, self.tokenizer
        seeds = list(D.pick_seeds(plan.question_batch, rng))
        prompts = [tok(D.user_turn_prefix(tok, s.system), add_special_tokens=False)["input_ids"] for s in seeds]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch well
        outs = self._write([prompts[i] for i in order], max_new=plan.question_tokens,
                           temperature=plan.question_temperature, top_p=plan.question_top_p,
                           seed=self.data_seed * 7919 + r, max_time=self._generate_time(0.3))
        kept: list[tuple[str, str]] = []
        counts = Counter()
        if r == 0:
            for q in self.extra_questions:
                seen.add(D.dedupe_key(q))
                kept.append(("given", q))
        for i, (ids, ended) in zip(order, outs):
            if not ended and plan.questions_must_end:
                counts["unfinished"] += 1
                continue
            text = D.clean_question(tok.decode(ids, skip_special_tokens=True))
            if text is None:
                counts["rejected"] += 1
                continue
            if self.refusals.match(text) is not None:
                counts["refused"] += 1
                continue
            key = D.dedupe_key(text)
            if key in seen:
                counts["duplicates"] += 1
                continue
            seen.add(key)
            kept.append((seeds[i].category, text))
        return kept, {"sampled": len(seeds), "kept": len(kept), **counts}

    def _answers(self, questions: list[tuple[str, str]], greedy: bool, rng: torch.Generator, seed: int,
                 history: list[tuple[str | None, tuple[dict, ...]]] | None = None) -> list[dict]:
        """The target's answers to (category, question) pairs; history: per question, the system and the
        conversation before it (a follow-up), else a system drawn for each."""
        plan, tok = self.plan, self.tokenizer
        if not questions:
            return []
        before = history or [(D.pick_answer_system(rng), ()) for _ in questions]
        prompts = [D.answer_prompt(tok, q, system, turns) for (_, q), (system, turns) in zip(questions, before)]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        options = dict(max_new=plan.answer_tokens, temperature=0.0 if greedy else plan.answer_temperature, top_p=1.0,
                       seed=seed, max_time=self._generate_time())
        outs = self._write([prompts[i] for i in order], segment=plan.answer_segment, **options)
        records = []
        for i, (ids, ended) in zip(order, outs):
            if len(ids) < 2:
                continue
            records.append({"question": questions[i][1], "category": questions[i][0], "greedy": greedy,
                            "ids": torch.tensor(prompts[i] + ids, dtype=torch.int32), "prompt_len": len(prompts[i]),
                            "system": before[i][0], "turns": len(before[i][1]) // 2 + 1, "ended": ended})
        return records

    def _followups(self, records: list[dict], greedy: bool, rng: torch.Generator, seen: set[str],
                   seed: int) -> tuple[list[dict], dict]:
        """Second turns: for a share of the finished first answers, the target writes what the user asks next
        (Magpie after the conversation so far), then answers it with the whole conversation as its prompt."""
        plan, tok = self.plan, self.tokenizer
        longest = self.sampler.max_length if self.sampler is not None else math.inf
        room = longest - plan.answer_tokens - plan.question_tokens - 64  # the conversation, a follow-up and its answer
        firsts = [r for r in records if r["ended"] and r["turns"] == 1 and r["ids"].numel() < room]
        order = torch.randperm(len(firsts), generator=rng).tolist()
        picked = [firsts[i] for i in order[: int(len(firsts) * plan.followup_share)]]
        if not picked:
            return [], {"asked": 0, "kept": 0}
        history = []
        for r in picked:
            answer = tok.decode(r["ids"][r["prompt_len"]:].tolist(), skip_special_tokens=True)
            history.append((r["system"], ({"role": "user", "content": r["question"]},
                                          {"role": "assistant", "content": answer})))
        prefixes = [tok(D.user_turn_prefix(tok, system, turns), add_special_tokens=False)["input_ids"]
                    for system, turns in history]
        outs = self._write(prefixes, max_new=plan.question_tokens, temperature=plan.question_temperature,
                           top_p=plan.question_top_p, seed=seed, max_time=self._generate_time(0.3))
        questions, kept_history = [], []
        for r, h, (ids, ended) in zip(picked, history, outs):
            text = D.clean_question(tok.decode(ids, skip_special_tokens=True))
            if text is None or (plan.questions_must_end and not ended) or self.refusals.match(text) is not None:
                continue
            key = D.dedupe_key(r["question"] + " / " + text)
            if key in seen:
                continue
            seen.add(key)
            questions.append((r["category"], text))
            kept_history.append(h)
        more = self._answers(questions, greedy, rng, seed, history=kept_history)
        return more, {"asked": len(picked), "kept": len(questions)}
