"""Qwen3 on the fast path: per-head q/k RMSNorm, checked against transformers' own forward."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from engine.decoding import Engine
from engine.runners.graphs import StaticGraphRunner, build_runners
from engine.types import GenerationRequest, ModelInfo
from tests.tiny import build_tokenizer

VOCAB = 320


def tiny_qwen3(vocab: int = VOCAB, *, seed: int, tied: bool = True) -> Qwen3ForCausalLM:
    """A 2-layer Qwen3 whose q/k norm weights are far from 1, so leaving them out shows."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=tied,
        initializer_range=0.3, rope_theta=10000.0,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.2, 3.0)
            layer.self_attn.k_norm.weight.uniform_(0.2, 3.0)
    return model


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()  # [T, V]


@pytest.mark.parametrize("tied", [True, False])
def test_lean_qwen3_matches_transformers_through_steps_and_rollbacks(tied):
    model = tiny_qwen3(seed=1, tied=tied)
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = StaticGraphRunner(model, max_length=128, graph_widths=(1, 2, 4))
    assert runner.decoder.layers[0].qk_norm is not None
    history: list[int] = []

    def feed(new: list[int]) -> None:
        out = runner.forward(torch.tensor(new))
        history.extend(new)
        torch.testing.assert_close(out, full_logits(model, history)[-len(new):], atol=1e-4, rtol=1e-4)

    feed(tokens[:17])
    for t in tokens[17:20]:
        feed([t])
    feed(tokens[20:25])
    runner.rollback(runner.length - 3)
    del history[-3:]
    feed(tokens[30:33])
    runner.rollback(8)
    del history[8:]
    feed(tokens[:4])


def test_the_q_k_norms_matter():
    """The check above can fail: without the per-head norms the logits differ from transformers'."""
    model = tiny_qwen3(seed=3)
    tokens = list(range(10, 30))
    runner = StaticGraphRunner(model, max_length=64, graph_widths=(1,))
    for layer in runner.decoder.layers:
        layer.qk_norm = None
    out = runner.forward(torch.tensor(tokens))
    assert not torch.allclose(out, full_logits(model, tokens), atol=1e-2, rtol=1e-2)


def _qwen3_pair(tmp_path):
    tok = build_tokenizer()
    target = tiny_qwen3(len(tok), seed=5)
    draft = Qwen3ForCausalLM(target.config).eval()
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():  # a noisy copy: agrees often, not always
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std().clamp_min(1e-3))
    info = ModelInfo(target_name="qwen3-target", draft_name="qwen3-draft", device="cpu", dtype="float32",
                     fast_path="static-eager", vocab_size=len(tok))
    return tok, target, draft, info


def test_greedy_speculative_equals_standard_on_qwen3_fast_path(tmp_path):
    tok, target, draft, info = _qwen3_pair(tmp_path)
    t, d, _ = build_runners(target, draft, max_length=256, k_max=6)
    fast = Engine(target, tok, info, draft=draft, target_runner=t, draft_runner=d)
    eager = Engine(target, tok, info, draft=draft)  # transformers' own Qwen3 forward
    for prompt in ("def add(a, b):\n    return a + b\ndef add(a, b):", "The quick brown fox", "快速排序是"):
        ref = list(eager.generate(GenerationRequest(prompt=prompt, mode="standard", max_new_tokens=40)))
        ref_text = "".join(s.text for s in ref)
        assert "".join(s.text for s in fast.generate(
            GenerationRequest(prompt=prompt, mode="standard", max_new_tokens=40))) == ref_text
        accepted = 0
        for k in (1, 3, 5):
            steps = list(fast.generate(GenerationRequest(prompt=prompt, mode="speculative", k=k, max_new_tokens=40)))
            assert "".join(s.text for s in steps) == ref_text, (prompt, k)
            accepted += sum(s.accepted for s in steps)
        assert accepted > 0  # the draft was really used
