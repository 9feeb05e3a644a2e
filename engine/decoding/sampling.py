"""Processed distributions (temperature, top-k, top-p) and the speculative acceptance rule."""
from __future__ import annotations

import torch

from engine.errors import GenerationError
from engine.types import Sampling

# Devices that draw by inverting the cumulative sum (`draw`) and cut top-p among the best tokens first
# (`process`): the CPU, where neither costs a host sync; elsewhere torch.multinomial and a whole sort.
HOST_SAMPLING = ("cpu",)


def process(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Float32 logits [..., V] -> the distribution actually sampled from [..., V].

    Greedy maps to a one-hot on the argmax so that the acceptance rule below reduces to
    "accept while the draft token equals the target's argmax" with no special case.
    """
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        logits = logits.masked_fill(_outside_nucleus(logits, sampling.top_p), float("-inf"))
    return logits.softmax(-1)


# On the CPU top-p looks for its cut among the best NUCLEUS_HEAD tokens first (a sort of a 152k row costs
# 11 ms on two cores, paid by every row a sampled round processes); rows whose best tokens hold less than
# top_p of the mass are sorted whole.
NUCLEUS_HEAD = 1024


def _outside_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] bool: the tokens top-p drops. Sorted by probability, a token is dropped when the mass before
    it already reaches top_p; the top token always stays."""
    vocab = logits.shape[-1]
    if logits.device.type in HOST_SAMPLING and vocab > NUCLEUS_HEAD:  # no host sync to fear on the CPU
        values, order = torch.topk(logits, NUCLEUS_HEAD, dim=-1)  # [..., H] best first
        probs = (values - torch.logsumexp(logits, -1, keepdim=True)).exp()  # their share of the whole law
        before = probs.cumsum(-1) - probs
        # every token past the head has at least the head's whole mass before it: dropped once that reaches top_p
        if bool((before[..., -1] + probs[..., -1] >= top_p).all()):
            kept = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
            return ~kept.scatter(-1, order, before < top_p)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def display_probs(logits: torch.Tensor, processed: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """What the hover shows: under greedy a one-hot says nothing, so show softmax at T=1;
    when sampling, the processed distribution itself (passed in: it is not computed twice)."""
    return logits.softmax(-1) if sampling.greedy else processed


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [R, V] -> [R].

    On a GPU through torch.multinomial. On the CPU by inverting each row's cumulative sum (float64) at a
    uniform draw: the same law, and on two cores 0.7 ms a 152k row where multinomial took 3 ms, paid by
    every sampled token, draft or target.

    Scores that are not numbers (damaged weights, an overflowing dtype) reach here as NaN rows: a
    GenerationError a person can act on (on a GPU torch's RuntimeError says so; checking for them on
    every step there would cost a host sync per step, while on the CPU the check is free).
    """
    if probs.device.type in HOST_SAMPLING:
        cumulative = probs.double().cumsum(-1)  # [R, V]
        total = cumulative[:, -1:]  # [R, 1]
        if not bool((torch.isfinite(total) & (total > 0)).all()):
            raise GenerationError(_NOT_FINITE)
        u = torch.rand(total.shape, generator=generator, dtype=torch.float64) * total  # [R, 1] in [0, total)
        # the first token whose cumulative sum passes u: never one of probability 0
        return torch.searchsorted(cumulative, u, right=True).clamp_max(probs.shape[-1] - 1).squeeze(-1)
    try:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    except RuntimeError as e:
        if "probability tensor" not in str(e):
            raise
        raise GenerationError(_NOT_FINITE) from None


_NOT_FINITE = ("The model's scores are not finite numbers (NaN or infinity): its weights may be damaged, or "
               "they overflow in this dtype; try --dtype float32 or another model.")


def accept_draft(
    draft: torch.Tensor,  # [K] proposed token ids
    q: torch.Tensor | None,  # [K, V] processed draft distributions; None = point masses on `draft`
    p: torch.Tensor,  # [K+1, V] processed target distributions (last row: the bonus position)
    greedy: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Leviathan et al. 2023, Algorithm 1 / Chen et al. 2023, vectorised over the K positions.

    Returns (accepted: [] long, added: [] long, accept_prob: [K]); all stay on the device so the
    caller syncs once per step.
    """
    k = draft.shape[0]
    rows = torch.arange(k, device=draft.device)
    p_x = p[rows, draft]  # [K] target probability of each draft token
    q_x = q[rows, draft] if q is not None else torch.ones_like(p_x)  # [K]
    accept_prob = torch.clamp(p_x / q_x.clamp_min(1e-20), max=1.0)  # [K]
    if greedy:
        ok = p_x > 0.5  # p is one-hot: the draft token is the target's argmax
    else:
        r = torch.rand(k, device=draft.device, generator=generator)  # [K]
        ok = r < accept_prob
    accepted = torch.cumprod(ok.long(), 0).sum()  # length of the accepted prefix
    if greedy:
        # p is one-hot, so the residual max(0, p - q) at a rejection is that same one-hot: the
        # target's token is the argmax of p's row at the first rejection (or the bonus row).
        return accepted, p.index_select(0, accepted.view(1))[0].argmax(), accept_prob
    # The token the target adds: at a rejection, from normalize(max(0, p - q)); after K accepts,
    # the bonus from p. Rows for every position are built so the choice needs no host sync.
    q_full = q if q is not None else torch.nn.functional.one_hot(draft, p.shape[-1]).to(p.dtype)
    residual = torch.clamp(p[:k] - q_full, min=0.0)  # [K, V]
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-20), p[:k])
    candidates = torch.cat([residual, p[k:]], 0)  # [K+1, V]
    # index_select, not candidates[accepted]: indexing with a 0-dim device tensor reads it on the host.
    added = draw(candidates.index_select(0, accepted.view(1)), generator)[0]
    return accepted, added, accept_prob
