"""A draft tree walked row by row on the host, for targets whose logits are in host memory (the CPU).

verify.verify_path walks a tree with no host sync: it processes every row of the tree forward and draws
the target's token after each, then finds the path among them. A GPU does the rows at once and a sync
would cost more than the rows the walk never reaches. On a CPU there is no sync to avoid and every row is
paid for: for a 65-row tree over a 152k vocabulary (2 cores) the display softmax and argmax of every row
cost 27 ms a greedy round, processing at T = 0.7 25 ms and top-p 0.9 470 ms, against under 1 ms a row on
the path. So here the walk goes down from the pending token one row at a time, processing, drawing and
showing only the rows it reaches: the same rule (the target's token y at a reached row, from its processed
law; the walk moves to the child that is y), the same outcome layout, at most max_depth + 1 rows.
"""
from __future__ import annotations

import torch

from engine.decoding.sampling import draw, process
from engine.runners.tree import TreeDraft
from engine.types import Sampling


def row_token(law: torch.Tensor, logits: torch.Tensor, children: list[int], sampling: Sampling,
              generator: torch.Generator | None) -> int:
    """The target's token after one reached row: its argmax under greedy, else a draw from its processed law
    [V]. Drawing y from p and going down to the child that is y accepts each child x with p(x), as recursive
    rejection sampling over point-mass siblings does (verify.tree_choices). `children`: the tokens drafted
    under the row (the rule needs none of them; a test's wrong rule does)."""
    if sampling.greedy:
        return int(logits.argmax())
    return int(draw(law.unsqueeze(0), generator)[0])


def walk_on_host(logits: torch.Tensor, tree: TreeDraft, sampling: Sampling,
                 generator: torch.Generator | None) -> torch.Tensor:
    """verify.verify_path's outcome [6D + 5 + 3N] for a tree whose logits [N + 1, V] are in host memory."""
    depth_max = tree.max_depth
    tokens, parents, ranks = tree.tokens.tolist(), tree.parents.tolist(), tree.ranks.tolist()
    q = tree.q.tolist()
    kids: list[list[int]] = [[] for _ in range(len(tokens) + 1)]  # rows under each row, 1-based
    for row, parent in enumerate(parents, start=1):
        kids[parent].append(row)
    laws: dict[int, torch.Tensor] = {}  # reached row -> the law people are shown (sampled: the one drawn from)

    def law_of(row: int) -> torch.Tensor:
        if row not in laws:
            # a one-hot says nothing under greedy: the softmax at T = 1, as verify.tree_choices shows it
            laws[row] = logits[row].float().softmax(-1) if sampling.greedy else \
                process(logits[row:row + 1].float(), sampling)[0]
        return laws[row]

    path, row = [0], 0
    while True:
        y = row_token(law_of(row), logits[row], [tokens[c - 1] for c in kids[row]], sampling, generator)
        child = next((c for c in kids[row] if tokens[c - 1] == y), None)
        if child is None:
            break
        path.append(child)
        row = child
    accepted, last = len(path) - 1, path[-1]
    best = min(kids[last], key=lambda c: ranks[c - 1]) if kids[last] else 0  # where the walk stopped
    rows = [path[i + 1] if i < accepted else best for i in range(depth_max)]  # [D] the shown rows
    shown = accepted + bool(kids[last])
    token = [tokens[r - 1] if r else 0 for r in rows]
    p_x = [float(law_of(parents[r - 1])[t]) if i < shown else 0.0 for i, (r, t) in enumerate(zip(rows, token))]
    q_x = [q[r - 1] if r else 1.0 for r in rows]
    accept_prob = [float(i < accepted) for i in range(depth_max)] if sampling.greedy else p_x
    rank = [ranks[r - 1] if r else 0 for r in rows]
    path_slots = path + [0] * (depth_max + 1 - len(path))
    counts = [shown, accepted, y, float(law_of(last)[y])]
    return torch.tensor(token + q_x + p_x + accept_prob + rank + path_slots + counts + tokens + parents + ranks,
                        dtype=torch.float32)
