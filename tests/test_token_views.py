"""Every character of an answer belongs to exactly one token view, also when the answer ends mid-character."""
from __future__ import annotations

import pytest
import torch

from engine.decoding import Engine
from engine.decoding.detok import REPLACEMENT
from engine.types import GenerationRequest, ModelInfo
from tests.engine_fixtures import tiny_engine

PROMPT = "hi"
ANSWER = " 快速排序 🙂 ok 我们✨🚀"


class ScriptedRunner:
    """A runner whose greedy choice at every position is scripted: the answer is known in advance."""

    name = "scripted"
    hidden = None  # no rows for a draft head

    def __init__(self, script: list[int], prompt_len: int, vocab: int, wrong_every: int = 0) -> None:
        self.script = script  # token ids of the answer, in order
        self.prompt_len = prompt_len  # the scripted answer starts after this many prompt tokens
        self.vocab_size = vocab
        self.wrong_every = wrong_every  # a draft that guesses every n-th token wrong (0: never)
        self.device = torch.device("cpu")
        self.max_length = 512
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def prefill(self, ids: torch.Tensor) -> None:
        self.length += ids.shape[-1]

    def reserve(self, length: int) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        width = ids.shape[-1]
        logits = torch.full((width, self.vocab_size), -30.0)
        for j in range(width):
            at = self.length + j + 1 - self.prompt_len  # index in the answer this row predicts
            token = self.script[min(max(at, 0), len(self.script) - 1)]
            if self.wrong_every and at % self.wrong_every == self.wrong_every - 1:
                token = (token + 1) % self.vocab_size
            logits[j, token] = 30.0
        self.length += width
        return logits

    def rollback(self, length: int) -> None:
        self.length = length

    def measure_costs(self, widths, iters: int = 1) -> dict[int, float]:
        return {}


@pytest.fixture(scope="module")
def scripted(tiny_pair):
    base = tiny_engine(*tiny_pair)
    tok = base.tokenizer
    prompt_len = len(tok(PROMPT, add_special_tokens=False)["input_ids"])
    script = tok(ANSWER, add_special_tokens=False)["input_ids"]
    vocab = base.vocab
    info = ModelInfo(target_name="t", draft_name="d", device="cpu", dtype="float32", fast_path="scripted",
                     vocab_size=vocab)

    def make() -> Engine:
        return Engine(base.target, tok, info, draft=base.draft, vocab=vocab,
                      target_runner=ScriptedRunner(script, prompt_len, vocab),
                      draft_runner=ScriptedRunner(script, prompt_len, vocab, wrong_every=3))

    return make, tok, script


def _cuts_inside_a_character(tok, script) -> list[int]:
    cuts = [n for n in range(1, len(script)) if tok.decode(script[:n]).endswith(REPLACEMENT)]
    assert cuts, "the answer must have characters split across tokens"
    return cuts


@pytest.mark.parametrize("mode", ["standard", "speculative"])
def test_answer_cut_inside_a_character_keeps_its_tail_in_a_token(scripted, mode):
    make, tok, script = scripted
    for n in _cuts_inside_a_character(tok, script):
        gen = make().generate(GenerationRequest(prompt=PROMPT, mode=mode, k=4, max_new_tokens=n))
        steps = list(gen)
        text = gen.summary.text
        assert text == tok.decode(script[:n]) and text.endswith(REPLACEMENT)
        kept = "".join(t.text for s in steps for t in s.tokens if t.status != "rejected")
        assert kept == text, (n, kept, text)
        for s in steps:
            assert "".join(t.text for t in s.tokens if t.status != "rejected") == s.text


def test_cli_json_tokens_add_up_to_the_text(scripted, monkeypatch, capsys):
    import json

    import app.cli
    import app.cli.common

    make, tok, script = scripted
    n = _cuts_inside_a_character(tok, script)[-1]
    monkeypatch.setattr(app.cli.common, "load_engine", lambda args, needs_draft, *rest, **kw: make())
    monkeypatch.setattr(app.cli.common, "environment", lambda engine: {})
    code = app.cli.main(["generate", "--prompt", PROMPT, "--raw", "--json", "--max-new-tokens", str(n), "--k", "4"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"].endswith(REPLACEMENT)
    assert "".join(t["text"] for t in out["tokens"] if t["status"] != "rejected") == out["text"]


def test_stop_string_cut_recuts_the_token_views(scripted):
    make, tok, script = scripted
    gen = make().generate(GenerationRequest(prompt=PROMPT, mode="speculative", k=4, max_new_tokens=len(script),
                                            stop_strings=("排序",)))
    steps = list(gen)
    text = gen.summary.text
    assert gen.summary.stop_reason == "stop_string" and "排序" not in text[:-1] and len(text) < len(ANSWER)
    assert "".join(t.text for s in steps for t in s.tokens if t.status != "rejected") == text
