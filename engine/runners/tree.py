"""A tree of draft tokens verified in one target forward (tree attention), and the shapes drafts take.

Row i of a tree forward writes cache slot start + i like any forward, but sits at position
start + depth[i] and attends to the cached prefix and to its own ancestors in the tree only
(itself included). A chain is the tree whose ancestors are the lower triangle.

The shape built here (`sibling_tree`) is the chain of K drafts plus, at each depth, S alternative
tokens that share the chain token's parent and end there (leaves): when the target rejects the
chain token at depth d but picks one of its alternatives, that alternative is kept and the
target's token after it comes from the same forward, one token more than the chain would give.
Rows: 0 the pending token, 1..K the chain, then K groups of S alternatives (depth 1..K).
After the step the kept alternative's cache slot is moved next to the accepted chain prefix
(Runner.keep_path), so the cache again holds one committed sequence.

A `TreeDraft` is any tree a proposer grew (the draft head's dynamic trees, engine/heads/tree.py):
N draft tokens under the pending token, each with its parent row; verify.verify_path walks it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    depth: torch.Tensor  # [W] long: each row's distance from row 0 (its position is start + depth)
    ancestors: torch.Tensor  # [W, W] bool: row i attends to row j (j an ancestor of i, or i itself)

    @property
    def width(self) -> int:
        return int(self.depth.shape[0])

    def to(self, device: torch.device) -> Tree:
        if self.depth.device == device:
            return self
        return Tree(self.depth.to(device), self.ancestors.to(device))

    def positions_and_mask(self, start: torch.Tensor, key_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """start: long scalar (the first row's slot), key_pos [L] slot numbers -> positions [W], mask [W, L].

        Slots before `start` (the committed prefix) are visible to every row; slots start..start+W-1
        are the tree's own rows, visible along ancestry; later slots (stale) are masked. No host
        sync and no data-dependent shape: capturable in a CUDA graph with the tree as a static input.
        """
        width = self.depth.shape[0]
        rel = key_pos - start  # [L] slot relative to the tree's first row
        inside = (rel >= 0) & (rel < width)
        tree_part = self.ancestors.index_select(1, rel.clamp(0, width - 1)) & inside[None, :]  # [W, L]
        return start + self.depth, (rel < 0)[None, :] | tree_part


@dataclass(frozen=True)
class TreeDraft:
    """N draft tokens as a tree under the pending token: rows 1..N of a tree forward, parents first.

    Siblings hold distinct tokens, which makes each node a point-mass draft that the target's own
    token at its parent's row either is or is not (verify.verify_path).
    """

    tokens: torch.Tensor  # [N] long: the target ids of rows 1..N
    parents: torch.Tensor  # [N] long: each row's parent row (0: the pending token), always a lower row
    ranks: torch.Tensor  # [N] long: each token's rank among its parent's drafted children (0: the drafter's best)
    q: torch.Tensor  # [N] float: the drafter's probability of each token after its parent (shown to people)
    shape: Tree  # depth [N + 1] and ancestors [N + 1, N + 1] of rows 0..N, for the target's forward
    max_depth: int  # the deepest a node may sit (host int: the outcome's size), >= every depth

    @property
    def nodes(self) -> int:
        return int(self.tokens.shape[0])


def chain_tree(width: int, device: torch.device | str = "cpu") -> Tree:
    """The ordinary causal sequence as a Tree (tests: a chain forward through the tree path)."""
    depth = torch.arange(width, device=device)
    return Tree(depth, torch.ones(width, width, dtype=torch.bool, device=device).tril())


def sibling_rows(k: int, s: int) -> int:
    """Rows of a sibling tree: the pending token, K chain drafts and S alternatives at each depth."""
    return 1 + k * (1 + s)


def sibling_tree(k: int, s: int, device: torch.device | str = "cpu") -> Tree:
    """The chain of K drafts with S leaf alternatives at each depth (layout in the module note)."""
    width = sibling_rows(k, s)
    depth = torch.zeros(width, dtype=torch.long)
    anc = torch.zeros(width, width, dtype=torch.bool)
    for j in range(k + 1):  # row 0 and the chain
        depth[j] = j
        anc[j, : j + 1] = True
    for d in range(k):  # alternatives at depth d + 1: children of chain row d
        for a in range(s):
            row = alt_row(k, s, d, a)
            depth[row] = d + 1
            anc[row, : d + 1] = True
            anc[row, row] = True
    return Tree(depth.to(device), anc.to(device))


def alt_row(k: int, s: int, d: int, a: int) -> int:
    """Row of alternative a at depth d + 1 (0-based d: the alternatives to chain draft d)."""
    return 1 + k + d * s + a
