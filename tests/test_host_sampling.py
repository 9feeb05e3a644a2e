"""Sampling the CPU's way (engine/decoding/sampling.py: HOST_SAMPLING): draws by inverting the cumulative sum,
and top-p cut among the best tokens first. The same law as torch.multinomial and a whole sort."""
from __future__ import annotations

import pytest
import torch
from scipy import stats as scipy_stats

from engine.decoding import sampling as smp
from engine.errors import GenerationError
from engine.types import Sampling


@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_top_p_cut_among_the_best_tokens_is_the_whole_sorts_cut(monkeypatch, top_p):
    """Rows whose best tokens hold top_p (cut among them) and rows that do not (sorted whole) alike."""
    monkeypatch.setattr(smp, "NUCLEUS_HEAD", 64)
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat_interleave(10).view(-1, 1)  # flat to peaked rows
    logits = torch.randn(40, 3000, generator=gen) * scale  # [40, V]
    held = 0
    for temperature, top_k in ((1.0, 0), (0.7, 0), (1.3, 500)):
        s = Sampling(temperature=temperature, top_p=top_p, top_k=top_k)
        monkeypatch.setattr(smp, "HOST_SAMPLING", ())
        whole = smp.process(logits, s)  # [40, V] one sort of every row
        monkeypatch.setattr(smp, "HOST_SAMPLING", ("cpu",))
        for row, expected in zip(logits, whole):
            fast = smp.process(row, s)  # [V]
            assert torch.equal(fast > 0, expected > 0) and torch.allclose(fast, expected, atol=1e-6)
            scaled = row / temperature
            held += bool((torch.topk(scaled, 64).values - torch.logsumexp(scaled, -1)).exp().sum() >= top_p)
        assert torch.allclose(smp.process(logits, s), whole, atol=1e-6)  # a batch of rows, as verify passes them
    assert 0 < held < 120, "rows cut among the best tokens and rows sorted whole both ran"


def test_draws_by_the_cumulative_sum_follow_the_law():
    """Chi-square against the law, zero-probability tokens never drawn, rows need not sum to 1."""
    law = torch.tensor([0.0, 0.05, 0.0, 0.5, 0.25, 0.2, 0.0])
    gen = torch.Generator().manual_seed(5)
    drawn = smp.draw((law * 3.0).repeat(40_000, 1), gen)  # [R] (unnormalised rows)
    counts = torch.bincount(drawn, minlength=7)
    assert counts[law == 0].sum() == 0
    kept = law > 0
    result = scipy_stats.chisquare(counts[kept].numpy(), (law[kept] * len(drawn)).numpy())
    assert result.pvalue > 1e-3, result
    one_hot = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    assert smp.draw(one_hot, gen).tolist() == [2, 0, 1]


@pytest.mark.parametrize("row", [[float("nan"), 0.5], [float("inf"), 0.5], [0.0, 0.0]])
def test_a_row_that_is_no_law_is_one_clear_error(row):
    with pytest.raises(GenerationError, match="not finite numbers"):
        smp.draw(torch.tensor([row]), None)
