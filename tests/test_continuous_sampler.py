"""The distillation's data writer: vectorised rows equal the per-row forward, continuous batching equals
greedy decoding of each prompt alone (float32), and sampling keeps the nucleus' law."""
from __future__ import annotations

import pytest
import torch

from engine.heads.generate import CHECK_EVERY, ContinuousSampler, NonFiniteLogits, _pick
from engine.runners.batched import BatchedDecoder, Part
from tests.tiny import build_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(96, seed=3, layers=2, hidden=64).float().eval()


def _greedy_alone(model, prompt: list[int], max_new: int, eos: set[int]) -> tuple[list[int], bool]:
    ids = list(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t in eos:
                return out, True
    return out, False


def test_rows_at_once_equal_each_row_by_itself(model):
    a, b, c = [5, 9, 33, 41, 7, 10, 3], [11, 12, 13], [40, 41, 42, 43, 44]
    with torch.inference_mode():
        ref = [model(torch.tensor([x])).logits[0] for x in (a, b, c)]
    dec = BatchedDecoder(model, 128, 4)
    # A right-padded prefill of rows 3, 0 and 1 (b and c padded to a's width), logits of each row's last real token.
    padded = torch.tensor([a, b + [0] * 4, c + [0] * 2])
    got = dec.forward_rows(padded, [0, 0, 0], slots=[3, 0, 1], take=torch.tensor([6, 2, 4]))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r[-1], atol=1e-4, rtol=1e-4)
    # One token per row at each row's own position; the padded slots past a row's length are masked.
    nxt = torch.tensor([[1], [2], [3], [4]])  # rows 0..3 (row 2 is free: position 0)
    got = dec.forward_rows(nxt, [len(b), len(c), 0, len(a)], kv_len=64)
    with torch.inference_mode():
        for row, prompt in ((0, b), (1, c), (3, a)):
            want = model(torch.tensor([prompt + [int(nxt[row])]])).logits[0, -1]
            torch.testing.assert_close(got[row], want, atol=1e-4, rtol=1e-4)
    # The per-part forward on the same cache agrees with the rows written by forward_rows.
    dec.lengths[3] = len(a) + 1
    (per_part,) = dec.forward([Part(3, (9,))])
    with torch.inference_mode():
        want = model(torch.tensor([a + [4, 9]])).logits[0, -1]
    torch.testing.assert_close(per_part[-1], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 8, 40])  # 40: the last rows are packed into the first (twice)
def test_greedy_continuations_equal_each_prompt_decoded_alone(model, rows):
    gen = torch.Generator().manual_seed(rows)
    count = 36 if rows == 40 else 11
    lengths = torch.randint(1, 30, (count,), generator=gen)
    prompts = [torch.randint(1, 96, (int(n),), generator=gen).tolist() for n in lengths]
    eos = [7, 19]  # frequent enough in a random model that some rows end early, some at once
    sampler = ContinuousSampler(model, rows=rows, max_length=80, eos=eos)
    got = sampler.run(prompts, max_new=3 * CHECK_EVERY + 5, temperature=0.0, top_p=1.0, seed=0)
    ended = 0
    for prompt, (ids, done) in zip(prompts, got):
        assert (ids, done) == _greedy_alone(model, prompt, 3 * CHECK_EVERY + 5, set(eos))
        ended += done
    assert 0 < ended < len(prompts)


def test_a_prompt_near_the_cache_end_stops_at_the_cache_and_an_empty_one_gets_nothing(model):
    sampler = ContinuousSampler(model, rows=2, max_length=40, eos=[])
    got = sampler.run([[3] * 35, [], [4, 5]], max_new=20, temperature=0.0, top_p=1.0, seed=0)
    assert len(got[0][0]) == 5 and got[0][1] is False
    assert got[1] == ([], False)
    assert len(got[2][0]) == 20


def test_prompts_longer_than_a_prefill_chunk(model):
    from engine.runners.lean import PREFILL_CHUNK

    long = (torch.arange(PREFILL_CHUNK + 40) % 90 + 1).tolist()
    sampler = ContinuousSampler(model, rows=2, max_length=PREFILL_CHUNK + 64, eos=[])
    got = sampler.run([long, [8, 9, 10]], max_new=6, temperature=0.0, top_p=1.0, seed=0)
    assert got[0] == _greedy_alone(model, long, 6, set())
    assert got[1] == _greedy_alone(model, [8, 9, 10], 6, set())


def test_sampling_is_reproducible_and_reaches_past_greedy(model):
    sampler = ContinuousSampler(model, rows=4, max_length=64, eos=[])
    prompts = [[5, 6, 7]] * 6
    one = sampler.run(prompts, max_new=12, temperature=1.0, top_p=0.95, seed=4)
    two = sampler.run(prompts, max_new=12, temperature=1.0, top_p=0.95, seed=4)
    assert one == two
    assert len({tuple(ids) for ids, _ in one}) > 1  # the same prompt, different draws


def test_the_nucleus_keeps_the_law_of_its_tokens():
    """top-p 0.7 over p = (.5, .3, .15, .05): the nucleus is the first two tokens, drawn as 5 : 3."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(40000, 4)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(_pick(logits, 1.0, 0.7, gen), minlength=4).double()
    assert counts[2] == 0 and counts[3] == 0
    expected = torch.tensor([0.625, 0.375], dtype=torch.float64) * 40000
    chi2 = float(((counts[:2] - expected) ** 2 / expected).sum())
    assert chi2 < 10.8  # 1 degree of freedom, p = 0.001


def test_logits_that_are_not_finite_stop_the_run_without_faulting_a_draw(model, monkeypatch):
    """A NaN row is drawn from as zeros (multinomial would fault, on CUDA the whole context), and the run
    raises NonFiniteLogits at its next sync, so the caller can write the data another way."""
    sampler = ContinuousSampler(model, rows=4, max_length=64, eos=[])
    real = sampler.decoder.forward_rows
    calls = []

    def broken(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            out[0, 5] = float("nan")
        return out

    monkeypatch.setattr(sampler.decoder, "forward_rows", broken)
    with pytest.raises(NonFiniteLogits):
        sampler.run([[5, 6, 7]] * 3, max_new=12, temperature=1.0, top_p=0.9, seed=0)
    monkeypatch.setattr(sampler.decoder, "forward_rows", real)
    assert len(sampler.run([[5, 6, 7]], max_new=4, temperature=1.0, top_p=0.9, seed=0)[0][0]) == 4  # usable again


def test_many_long_prompts_prefill_in_groups(model, monkeypatch):
    """Admitted prompts prefill in groups of at most PREFILL_TOKENS padded tokens a forward."""
    from engine.heads import generate as G

    monkeypatch.setattr(G, "PREFILL_TOKENS", 64)
    sampler = ContinuousSampler(model, rows=6, max_length=80, eos=[])
    widths = []
    real = sampler.decoder.forward_rows
    monkeypatch.setattr(sampler.decoder, "forward_rows",
                        lambda ids, *a, **kw: widths.append(tuple(ids.shape)) or real(ids, *a, **kw))
    prompts = [list(range(1, 1 + n)) for n in (30, 5, 20, 7, 30, 12)]
    got = sampler.run(prompts, max_new=3, temperature=0.0, top_p=1.0, seed=0)
    prefills = [w for w in widths if w[1] > 1]
    assert all(b * w <= 64 for b, w in prefills) and sum(b for b, _ in prefills) == 6
    assert got == [_greedy_alone(model, p, 3, set()) for p in prompts]


def test_the_step_from_static_buffers_writes_what_the_plain_forward_writes(model):
    """RowSteps (the step a CUDA graph replays, here eagerly from its buffers) against forward_rows called with
    the step's own tensors: the same logits and caches. (Every run above goes through it for its full-width
    steps: greedy continuations equal to each prompt decoded alone.)"""
    from engine.heads.generate import RowSteps

    dec = BatchedDecoder(model, 64, 4)
    steps = RowSteps(dec, graphs=True)  # on a CPU: no capture, the same body from the static buffers
    assert not steps.graphs_on
    plain = BatchedDecoder(model, 64, 4)
    prompts = [[5, 9, 33], [11, 12], [40, 41, 42, 43], [7]]
    for d in (dec, plain):
        for slot, p in enumerate(prompts):
            d.forward_rows(torch.tensor([p]), [0], slots=[slot])
    nxt, starts = torch.tensor([1, 2, 3, 4]), [len(p) for p in prompts]
    got = steps(nxt, starts, dec.span(max(starts) + 1))
    want = plain.forward_rows(nxt[:, None], starts, kv_len=plain.span(max(starts) + 1))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(dec.kv, plain.kv, atol=0, rtol=0)


@pytest.mark.gpu
def test_the_step_replayed_as_cuda_graphs_writes_the_eager_step_answers(model):
    """On CUDA (float32): the step of every row replayed as CUDA graphs (one per attention span, several spans
    here) gives the eager step's answers, greedy and sampled, token for token."""
    cuda = build_model(96, seed=3, layers=2, hidden=64).float().eval().cuda()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 96, (int(n),), generator=gen).tolist() for n in torch.randint(1, 40, (12,), generator=gen)]
    for temperature in (0.0, 0.9):
        samplers = [ContinuousSampler(cuda, rows=4, max_length=600, eos=[], graphs=g) for g in (True, False)]
        runs = [s.run(prompts, max_new=300, temperature=temperature, top_p=1.0, seed=1) for s in samplers]
        assert runs[0] == runs[1] and all(len(ids) == 300 for ids, _ in runs[0])  # past a 256-slot span
        assert len(samplers[0].steps.graphs) >= 2 and not samplers[1].steps.graphs
