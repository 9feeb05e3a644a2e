"""Training a draft head on the target's own features: unrolled drafting, cross-entropy and regression.

One batch: the target reads the sequences once (no gradient) and gives the fused layers' states
and its final normed state at every position; its own output rows over the draft vocabulary give
the teacher distribution. The head then drafts `depth` steps from every position at once, as it
will while decoding (EAGLE-3's training-time test): step 0 reads the target's features, step s
reads the head's own state from step s-1 and the true token s+1 ahead, and attends to the
step-0 keys of the prefix plus its own row's keys of steps 1..s, at RoPE positions j + s. The
loss at each step is the cross-entropy against the target's distribution (EAGLE) plus a
regression of the head's normed state onto the target's (EAGLE-1's feature loss), step s
weighted decay**s. Only positions that predict answer tokens count.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.heads.model import DraftHead, rope


@dataclass(frozen=True)
class TrainConfig:
    depth: int = 6  # draft steps unrolled per position (covers K up to depth)
    step_decay: float = 0.8  # weight of step s is decay**s: early drafts matter most
    reg_weight: float = 0.3  # feature regression next to the cross-entropy
    lr: float = 5e-4  # AdamW peak learning rate
    warmup: float = 0.04  # share of the training time spent warming the learning rate up
    final_lr: float = 0.1  # learning rate at the end, as a share of the peak (cosine decay)
    clip: float = 1.0  # gradient norm clip
    batch_tokens: int = 16384  # padded tokens per batch
    max_len: int = 640  # longer sequences are cut to this many tokens


@dataclass(frozen=True)
class Sequence:
    ids: torch.Tensor  # [L] int32 prompt + answer (EOS included when the answer ended)
    prompt_len: int  # tokens of the prompt (chat template included)
    greedy: bool  # the answer was decoded greedily (those make the evaluation set)


def batches(seqs: list[Sequence], batch_tokens: int, max_len: int, generator: torch.Generator) -> list[list[int]]:
    """Indices of `seqs` grouped by length into batches of at most batch_tokens padded tokens, shuffled."""
    order = sorted(range(len(seqs)), key=lambda i: min(len(seqs[i].ids), max_len))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = min(len(seqs[i].ids), max_len)
        if current and width * (len(current) + 1) > batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    perm = torch.randperm(len(groups), generator=generator).tolist()
    return [groups[p] for p in perm]


def collate(seqs: list[Sequence], max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, T] right-padded with 0, lengths [B], prompt lengths [B]) on `device`."""
    lengths = [min(len(s.ids), max_len) for s in seqs]
    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, (s, n) in enumerate(zip(seqs, lengths)):
        ids[row, :n] = s.ids[:n].long()
    return ids.to(device), torch.tensor(lengths, device=device), torch.tensor([s.prompt_len for s in seqs], device=device)


class Teacher:
    """The target's features and final normed states for a batch, by hooks on its decoder layers."""

    def __init__(self, target, layers: tuple[int, ...]) -> None:
        self.target = target
        self.layers = layers
        self._captured: dict[int, torch.Tensor] = {}
        blocks = target.model.layers
        self._hooks = [blocks[i].register_forward_hook(self._hook(i)) for i in layers]

    def _hook(self, index: int):
        def keep(module, args, output) -> None:
            self._captured[index] = output[0] if isinstance(output, tuple) else output

        return keep

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] -> (features [B, T, n_feat * H], final normed states [B, T, H]) in the target's dtype."""
        mask = (torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]).long()
        self._captured.clear()
        out = self.target.model(input_ids=ids, attention_mask=mask, use_cache=False)
        features = torch.cat([self._captured[i] for i in self.layers], dim=-1)
        self._captured.clear()
        return features, out.last_hidden_state


def shift(x: torch.Tensor, by: int, fill: float | int = 0) -> torch.Tensor:
    """x [B, T, ...] moved `by` positions left along T (row j gets row j + by), padded with `fill`."""
    if by == 0:
        return x
    pad = x.new_full((x.shape[0], by, *x.shape[2:]), fill)
    return torch.cat([x[:, by:], pad], dim=1)


def unrolled_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, ks: list[torch.Tensor],
                       vs: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Attention of draft step s (s = len(ks)) for every row at once.

    q [B, T, Hq, D]; k0/v0 [B, T, Hkv, D] from step 0 (row j sees rows <= j); ks/vs: the row's
    own keys/values of steps 1..s (row j sees only its own). Returns [B, T, Hq * D].
    """
    b, t, hq, d = q.shape
    hkv = k0.shape[2]
    g = hq // hkv
    qh = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    k0h = k0.permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, T, D]
    v0h = v0.permute(0, 2, 1, 3)[:, :, None]
    scores = torch.matmul(qh, k0h.transpose(-1, -2)) * scale  # [B, Hkv, G, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    own = [(qh * k.permute(0, 2, 1, 3)[:, :, None]).sum(-1, keepdim=True) * scale for k in ks]  # [B, Hkv, G, T, 1]
    probs = torch.cat([scores, *own], dim=-1).float().softmax(-1).to(q.dtype)  # [B, Hkv, G, T, T + s]
    out = torch.matmul(probs[..., :t], v0h)  # [B, Hkv, G, T, D]
    for i, v in enumerate(vs):
        out = out + probs[..., t + i : t + i + 1] * v.permute(0, 2, 1, 3)[:, :, None]
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, hq * d)


def unrolled_states(head: DraftHead, features: torch.Tensor, ids: torch.Tensor, depth: int,
                    cos: torch.Tensor, sin: torch.Tensor) -> Iterator[torch.Tensor]:
    """The head's state after each of `depth` draft steps from every row: yields [B, T, H] per step.

    Row j at step s reads token ids[j + 1 + s] and sits at position j + s (cos/sin [>= T + depth, D]).
    """
    c = head.config
    t = ids.shape[1]
    h = head.fuse(features)  # [B, T, H]
    # per layer: the keys/values of step 0 (seen causally), then each later step's (seen by its own row only)
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(c.layers)]
    for s in range(depth):
        emb = head.embed_ids(shift(ids, 1 + s))  # [B, T, H]
        for i, layer in enumerate([head, *head.more]):
            q, k, v = head.project(h, emb) if i == 0 else layer.project(h)
            cs, sn = cos[s : s + t].to(q.dtype), sin[s : s + t].to(q.dtype)
            q, k = rope(q, cs, sn), rope(k, cs, sn)
            kv[i].append((k, v))
            (k0, v0), later = kv[i][0], kv[i][1:]
            o = unrolled_attention(q, k0, v0, [x for x, _ in later], [y for _, y in later], c.head_dim**-0.5)
            h = layer.finish(h, o)
        yield h


def step_mask(lengths: torch.Tensor, prompt_lens: torch.Tensor, width: int, s: int) -> torch.Tensor:
    """[B, T] rows whose step-s draft predicts an answer token that exists (position j + 1 + s)."""
    target = torch.arange(width, device=lengths.device)[None] + 1 + s  # teacher position
    return (target <= lengths[:, None] - 1) & (target >= prompt_lens[:, None] - 1)


@dataclass
class StepStats:
    loss: float  # weighted total
    ce: list[float]  # cross-entropy per draft step
    reg: list[float]  # feature regression per draft step
    acc: list[float]  # head argmax == teacher argmax (draft vocabulary), per step
    tokens: int  # answer positions trained on (step 0)


def head_loss(head: DraftHead, features: torch.Tensor, normed: torch.Tensor, ids: torch.Tensor,
              lengths: torch.Tensor, prompt_lens: torch.Tensor, cfg: TrainConfig,
              cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, StepStats]:
    """The weighted loss of one batch (with its graph) and what to log."""
    assert head.lm_rows is not None
    with torch.no_grad():
        teacher = F.linear(normed, head.lm_rows.to(normed.dtype)).float().log_softmax(-1)  # [B, T, Vd]
    total = torch.zeros((), device=ids.device)
    ces, regs, accs = [], [], []
    tokens = 0
    for s, h in enumerate(unrolled_states(head, features, ids, cfg.depth, cos, sin)):
        rows, cols = step_mask(lengths, prompt_lens, ids.shape[1], s).nonzero(as_tuple=True)  # [N] each
        n = rows.numel()
        if s == 0:
            tokens = n
        if n == 0:
            ces.append(0.0), regs.append(0.0), accs.append(0.0)
            continue
        state = head.normed(h[rows, cols])  # [N, H]
        logits = F.linear(state, head.lm_rows.to(state.dtype)).float()  # [N, Vd]
        t_logp = teacher[rows, cols + 1 + s]  # [N, Vd] the target's distribution of the same token
        ce = -(t_logp.exp() * logits.log_softmax(-1)).sum(-1).mean()
        reg = F.smooth_l1_loss(state.float(), normed[rows, cols + 1 + s].float())
        total = total + cfg.step_decay**s * (ce + cfg.reg_weight * reg)
        with torch.no_grad():
            accs.append(float((logits.argmax(-1) == t_logp.argmax(-1)).float().mean()))
        ces.append(float(ce.detach()))
        regs.append(float(reg.detach()))
    return total, StepStats(float(total.detach()), ces, regs, accs, tokens)


@torch.no_grad()
def greedy_acceptance(head: DraftHead, features: torch.Tensor, normed: torch.Tensor, lm_head,
                      ids: torch.Tensor, lengths: torch.Tensor, prompt_lens: torch.Tensor, depth: int,
                      cos: torch.Tensor, sin: torch.Tensor) -> tuple[list[int], list[int]]:
    """(hits, counts) per draft step: the head's token (mapped to target ids) equals the target's argmax.

    Over the full vocabulary: a target argmax outside the draft vocabulary is a miss, as in decoding.
    On greedy answers this is the acceptance of draft position s given the earlier ones were accepted.
    """
    def out(chunk: torch.Tensor) -> torch.Tensor:  # the weight, or the output module itself (a packed one)
        return lm_head(chunk) if callable(lm_head) else F.linear(chunk, lm_head.to(chunk.dtype))

    full = torch.cat([out(chunk).argmax(-1) for chunk in normed.split(8, dim=0)])  # [B, T]
    hits, counts = [], []
    for s, h in enumerate(unrolled_states(head, features, ids, depth, cos, sin)):
        rows, cols = step_mask(lengths, prompt_lens, ids.shape[1], s).nonzero(as_tuple=True)
        drafted = head.d2t[head.logits(h[rows, cols]).argmax(-1)]
        hits.append(int((drafted == full[rows, cols + 1 + s]).sum()))
        counts.append(int(rows.numel()))
    return hits, counts


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Tokens per target forward with K chained drafts: 1 + sum over k of the product of the first k rates."""
    total, reach = 1.0, 1.0
    for a in acceptance[:k]:
        reach *= a
        total += reach
    return total


def lr_at(progress: float, cfg: TrainConfig) -> float:
    """Learning rate at `progress` (0..1 of the training time): linear warm-up, cosine to final_lr."""
    if progress < cfg.warmup:
        return cfg.lr * max(progress / cfg.warmup, 0.02)
    x = min((progress - cfg.warmup) / max(1.0 - cfg.warmup, 1e-9), 1.0)
    return cfg.lr * (cfg.final_lr + (1 - cfg.final_lr) * 0.5 * (1 + math.cos(math.pi * x)))
