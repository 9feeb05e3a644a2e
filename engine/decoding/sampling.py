"""Processed distributions (temperature, top-k, top-p) and the speculative acceptance rule."""
from __future__ import annotations

import torch

from engine.errors import GenerationError
from engine.types import Sampling


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
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def display_probs(logits: torch.Tensor, processed: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """What the hover shows: under greedy a one-hot says nothing, so show softmax at T=1;
    when sampling, the processed distribution itself (passed in: it is not computed twice)."""
    return logits.softmax(-1) if sampling.greedy else processed


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [R, V] -> [R].

    Scores that are not numbers (damaged weights, an overflowing dtype) reach here as NaN rows;
    torch says so in a RuntimeError, which becomes a GenerationError a person can act on (checking
    for them on every step instead would cost a host sync per step).
    """
    try:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    except RuntimeError as e:
        if "probability tensor" not in str(e):
            raise
        raise GenerationError(
            "The model's scores are not finite numbers (NaN or infinity): its weights may be damaged, or "
            "they overflow in this dtype; try --dtype float32 or another model."
        ) from None


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
