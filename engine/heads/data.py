"""Training data written by the target itself: Magpie-style questions, then the target's answers.

No data set is downloaded. The target's chat template is rendered up to the start of a user turn
(optionally after a short steering system prompt: code, math, chat, long-form, in English and
Chinese) and the target samples what a user would write there (Magpie, Xu et al. 2024). The
questions are filtered, deduplicated and checked against the benchmark, edit and test prompts,
which are never trained on. The target then answers them, greedily and sampled, in batches,
with the same template the engine uses, so the head learns the target's own continuations.
"""
from __future__ import annotations

import json
import logging
import re
import time
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SENTINEL = "\u2063SPECDEC_USER_TURN\u2063"  # marks where the user's text would start in the template
NGRAM = 6  # characters per n-gram when comparing a question with a refused prompt
REFUSE_OVERLAP = 0.5  # share of a prompt's n-grams another may contain before it counts as the same
MIN_CHARS, MAX_CHARS = 8, 1200  # plausible question lengths


@dataclass(frozen=True)
class Seed:
    """A steering system prompt for question generation (None: the template's own default)."""

    category: str  # what kind of questions it tends to produce (logged, balanced over)
    language: str  # "en" or "zh"
    system: str | None  # the system message, or None for the template's default
    weight: float  # share of question batches that use it


# Short steering prompts (Magpie uses the model's own default; these spread the questions over
# what people ask a coder-instruct model, about half of it in Chinese like the shared prompts).
SEEDS: tuple[Seed, ...] = (
    Seed("general", "en", None, 1.0),
    Seed("code", "en", "You are a coding assistant. Users ask you to write, explain or debug Python code.", 1.5),
    Seed("code", "en", "You are a coding assistant. Users ask about JavaScript, TypeScript, HTML and CSS.", 0.7),
    Seed("code", "en", "You are a coding assistant. Users ask for SQL queries, data analysis with pandas, "
                       "and database design.", 0.6),
    Seed("code", "en", "You are a coding assistant. Users ask about C++, Rust, Go, Java, shell scripts and git.", 0.7),
    Seed("code_edit", "en", "Users paste a short piece of code and ask you to refactor it, fix a bug, add "
                            "type hints or docstrings, or write unit tests for it.", 0.8),
    Seed("math", "en", "You are a math tutor. Users ask math problems (arithmetic, algebra, probability, "
                       "geometry, proofs) and want step-by-step solutions.", 1.0),
    Seed("longform", "en", "Users ask for detailed articles, blog posts, essays and technical explanations "
                           "of several hundred words.", 0.9),
    Seed("chat", "en", "Users ask for everyday advice about work, study, health, travel and relationships.", 0.8),
    Seed("short", "en", "Users ask short factual questions, definitions and translations.", 0.5),
    Seed("summarize", "en", "Users paste a paragraph of text and ask you to summarize or rewrite it.", 0.4),
    Seed("tech", "en", "Users ask about machine learning, large language models, GPUs and computer systems.", 0.6),
    Seed("code", "zh", "你是一个编程助手。用户用中文提问，请你编写、解释或调试Python代码。", 1.2),
    Seed("code", "zh", "你是一个编程助手。用户用中文询问JavaScript、SQL、C++、Java等编程问题。", 0.7),
    Seed("math", "zh", "你是一个数学老师。用户用中文提出数学题，需要详细的解题步骤。", 0.9),
    Seed("longform", "zh", "用户用中文请你写文章、技术方案、报告或详细的介绍。", 1.0),
    Seed("chat", "zh", "用户用中文向你寻求生活、学习、健康和工作方面的建议。", 0.8),
    Seed("short", "zh", "用户用中文问简短的常识问题或翻译问题。", 0.5),
    Seed("tech", "zh", "用户用中文询问人工智能、大语言模型、本地部署和计算机硬件方面的问题。", 0.7),
)

# Answers are generated with the template as the engine renders requests: the CLI and bench send
# the user message alone (the template's default system prompt), the app adds this one.
ANSWER_SYSTEMS: tuple[tuple[str | None, float], ...] = ((None, 0.7), ("You are a helpful assistant.", 0.3))


# -------------------------------------------------------------------------------- refusals

def _normalise(text: str) -> str:
    """Lower case, NFKC, letters and digits only: the same question typed differently compares equal."""
    text = unicodedata.normalize("NFKC", text).lower()
    return "".join(ch for ch in text if ch.isalnum())


def _ngrams(text: str) -> set[str]:
    norm = _normalise(text)
    if len(norm) < NGRAM:
        return {norm} if norm else set()
    return {norm[i : i + NGRAM] for i in range(len(norm) - NGRAM + 1)}


def _read_prompts(path: Path | Iterable[str]) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines() if isinstance(path, Path) else path
    out = []
    for line in lines:
        line = line.strip()
        if line:
            row = json.loads(line)
            out.append(row["prompt"] if isinstance(row, dict) else str(row))
    return out


def packaged_refusals() -> list[str]:
    """The benchmark, edit and test prompts that must never be trained on (packaged copies)."""
    assets = resources.files("assets")
    prompts: list[str] = []
    for name in ("bench_prompts.jsonl", "edit_prompts.jsonl", "heads/refused_prompts.jsonl"):
        item = assets.joinpath(name)
        if item.is_file():
            prompts += _read_prompts(item.read_text(encoding="utf-8").splitlines())
    return prompts


class Refusals:
    """Says whether a text is (or contains, or is contained in) one of the refused prompts."""

    def __init__(self, prompts: Iterable[str]) -> None:
        self.prompts = [p for p in prompts if _normalise(p)]
        self.grams = [_ngrams(p) for p in self.prompts]

    def match(self, text: str) -> str | None:
        """The refused prompt `text` overlaps with, or None."""
        grams = _ngrams(text)
        if not grams:
            return None
        norm = _normalise(text)
        for prompt, ref in zip(self.prompts, self.grams):
            if norm == _normalise(prompt):
                return prompt
            shared = len(grams & ref)
            # Either one mostly inside the other: a paraphrase wrapped around a benchmark prompt,
            # or a question that is a piece of one. Tiny texts (< 3 n-grams) only match exactly.
            if min(len(grams), len(ref)) >= 3 and shared >= REFUSE_OVERLAP * min(len(grams), len(ref)):
                return prompt
        return None


# -------------------------------------------------------------------------------- templates

def user_turn_prefix(tokenizer, system: str | None, history: tuple[dict, ...] = ()) -> str:
    """The chat template rendered up to where a user's message begins (Magpie's pre-query template),
    after the conversation so far (`history`: role/content messages) for a follow-up question."""
    messages = ([{"role": "system", "content": system}] if system else []) + list(history) + [
        {"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if SENTINEL not in text:
        raise ValueError("the tokenizer's chat template does not render the user's message")
    return text[: text.index(SENTINEL)]


def answer_prompt(tokenizer, question: str, system: str | None, history: tuple[dict, ...] = ()) -> list[int]:
    """Prompt ids exactly as the engine encodes a chat request (engine.decoding.loop.Engine.encode), after
    the conversation so far (`history`) for a follow-up."""
    messages = ([{"role": "system", "content": system}] if system else []) + list(history) + [
        {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# -------------------------------------------------------------------------------- generation

def eos_ids(tokenizer, model) -> list[int]:
    """The ids that end an answer (the tokenizer's and the generation config's)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return sorted(ids)


def sample_batches(model, tokenizer, prompts: list[list[int]], **options) -> list[tuple[list[int], bool]]:
    """sample_batch, split in halves (recursively) when the device runs out of memory."""
    try:
        return sample_batch(model, tokenizer, prompts, **options)
    except torch.OutOfMemoryError:
        if len(prompts) < 2:
            raise
        torch.cuda.empty_cache()
        half = len(prompts) // 2
        log.warning("out of memory generating %d sequences at once; splitting the batch", len(prompts))
        return (sample_batches(model, tokenizer, prompts[:half], **options)
                + sample_batches(model, tokenizer, prompts[half:], **options))


def sample_segmented(model, tokenizer, prompts: list[list[int]], *, max_new: int, segment: int = 0,
                     seed: int, max_time: float | None = None, **options) -> list[tuple[list[int], bool]]:
    """sample_batches in segments of `segment` new tokens: after each, the rows that ended drop out.

    A batched generate runs every row until the longest is done; answers vary from a line to the
    limit, so most rows would be dead weight for the last steps. Rows that go on are continued from
    their prompt plus what they wrote (one more prefill, done in parallel). segment 0: one call.
    Each segment samples with its own seed; greedy answers equal the one-call answers.
    """
    if segment <= 0 or segment >= max_new:
        return sample_batches(model, tokenizer, prompts, max_new=max_new, seed=seed, max_time=max_time, **options)
    deadline = None if max_time is None else time.perf_counter() + max_time
    written: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    live = list(range(len(prompts)))
    part = 0
    while live:
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            break
        budget = min(segment, max_new - len(written[live[0]]))
        outs = sample_batches(model, tokenizer, [prompts[i] + written[i] for i in live], max_new=budget,
                              seed=seed + 7919 * part, max_time=left, **options)
        for i, (ids, done) in zip(live, outs):
            written[i] += ids
            ended[i] = done
        live = [i for i in live if not ended[i] and len(written[i]) < max_new]
        part += 1
    return list(zip(written, ended))


@torch.inference_mode()
def sample_batch(
    model, tokenizer, prompts: list[list[int]], *, max_new: int, temperature: float, top_p: float, seed: int,
    max_time: float | None = None,
) -> list[tuple[list[int], bool]]:
    """Continues each prompt (left-padded batch, Hugging Face generate); (new ids, ended with EOS) per prompt.

    temperature 0 is greedy. New ids stop after the first EOS (kept). max_time (seconds) cuts the
    whole batch short, so a slow machine cannot overrun a time budget.
    """
    from transformers import GenerationConfig

    device = model.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    eos = eos_ids(tokenizer, model)
    config = GenerationConfig(
        max_new_tokens=max_new, do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
        top_p=top_p if temperature > 0 else None, top_k=0 if temperature > 0 else None,
        pad_token_id=pad, eos_token_id=eos, max_time=max_time,
    )
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    results = []
    for row in out[:, width:].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        results.append((row[: end + 1] if end is not None else row, end is not None))
    return results


def clean_question(text: str) -> str | None:
    """A generated user turn, stripped; None when it does not look like a real question."""
    text = text.strip()
    if not (MIN_CHARS <= len(text) <= MAX_CHARS):
        return None
    if "<|" in text or re.search(r"(.)\1{9,}", text):  # template tokens, or "!!!!!!!!!!"
        return None
    if re.match(r"^(assistant|system|user)\b", text, flags=re.IGNORECASE):
        return None
    return text


def dedupe_key(text: str) -> str:
    """Questions that differ only in spacing, case or punctuation (or share a long opening) are duplicates."""
    return _normalise(text)[:48]


def pick_seeds(count: int, rng: torch.Generator) -> Iterator[Seed]:
    """`count` seeds drawn by weight (reproducible from the generator)."""
    weights = torch.tensor([s.weight for s in SEEDS])
    for i in torch.multinomial(weights, count, replacement=True, generator=rng).tolist():
        yield SEEDS[i]


def pick_answer_system(rng: torch.Generator) -> str | None:
    weights = torch.tensor([w for _, w in ANSWER_SYSTEMS])
    return ANSWER_SYSTEMS[int(torch.multinomial(weights, 1, generator=rng))][0]
