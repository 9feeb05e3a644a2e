"""One source for the limits every layer reads: draft length, cached context, measured widths."""
from __future__ import annotations

# Largest K (draft tokens per step) anywhere: the loop accepts it, the UI offers it, the fast path
# captures a verify graph for every width up to K_MAX + 1, and the cost model measures those widths.
# Acceptance decays geometrically with draft position, so longer drafts never paid in any
# measurement (H200 and CPU sweeps peak at K = 2..6).
K_MAX = 12

# Longest draft verified as a tree of drafts (a draft head's alternatives beside each token,
# engine/runners/tree.py): tree graphs are captured for K = 1..TREE_K_MAX; longer drafts verify as chains.
TREE_K_MAX = 8
TREE_ALTERNATIVES = 2  # default next-best tokens per draft position on a GPU (bench/head_speedup.py measures 0..3)
TREE_ALTERNATIVES_MAX = 3  # the most a head proposal carries (engine/heads/runner.py keeps this many)
# Dynamic trees (engine/heads/tree.py): nodes expanded per level, and the most nodes one verifies (the
# target's tree forward is one prompt chunk wide at most).
TREE_FRONTIER = 8
TREE_NODES_MAX = 255
# The tree a GPU drafts by default, and how it is fitted to the costs measured at load: halved (down to
# TREE_NODES_MIN, then chains) while its verify at the default K costs more than TREE_COST_LIMIT times a
# chain's. In an H200 sweep of 16 to 128 nodes (bench/results/h200_tree_sweep_*.json) 64 nodes, F = 8, K = 5
# measured fastest, greedy and at T = 0.7, its verify 1.13x a chain's; 96 and 128 nodes cost 1.18x and 1.20x
# and measured slower.
TREE_NODES = 64
TREE_NODES_MIN = 16
TREE_COST_LIMIT = 1.15
# The smallest tree is kept against chains on a limit of its own: it keeps about 1.3x a chain's tokens a round
# (3.43 against 2.68 at K = 5 on a 2-core Xeon, bench/results/cpu_tree_sweep_bf16.json, where its verify cost
# 1.13x a chain's and it measured 2.11x standard against the chain's 1.89x), so it pays until its verify costs
# about that much more; the limit leaves a margin.
TREE_MIN_COST_LIMIT = 1.25


def tree_nodes(nodes: int, frontier: int, depth: int) -> int:
    """Nodes a dynamic tree of `depth` levels verifies: N, or fewer when its levels hold fewer candidates."""
    return min(nodes, frontier + (depth - 1) * frontier * frontier)


def tree_widths(nodes: int = TREE_NODES, frontier: int = TREE_FRONTIER) -> tuple[int, ...]:
    """The target's forward widths (nodes + the pending token) of a dynamic tree over every depth."""
    return tuple(sorted({1 + tree_nodes(nodes, frontier, d) for d in range(1, TREE_K_MAX + 1)}))

# Widths the batched forward's CUDA graphs are captured at (engine/runners/batched_graphs.py): every row of a
# batch is right-padded to the nearest, up to a verify of K_MAX drafts; the GPU's matmuls cost about the same
# for a few more rows, and each width is one graph per attention span.
BATCH_WIDTHS = (1, 2, 3, 4, 6, 8, 10, K_MAX + 1)
# A prompt chunk (at most PREFILL_CHUNK, engine/runners/lean.py) in a batched row, right-padded to one of these:
# the batched forward's prefill graphs (engine/runners/batched_graphs.py).
PREFILL_WIDTHS = (32, 64, 128, 256)

# Draft length when a person has not chosen one.
DEFAULT_K = 5

# A request's K meaning "chosen per step": the controller (engine/decoding/control.py) picks K in
# 0..K_MAX before each step from the measured costs and acceptance; 0 there is a standard step.
# Like top_k = 0 ("off"), it is the one value a fixed K can never take.
K_AUTO = 0



def widest_draft(mode: str, k: int) -> int:
    """The most draft tokens one step may verify: the room a request needs beyond its prompt, less one."""
    if mode == "standard":
        return 0
    return K_MAX if mode == "auto" or k == K_AUTO else k


# Cache positions of the static-cache fast path when the caller does not say (capped by the
# model's own max_position_embeddings).
DEFAULT_MAX_LENGTH = 8192

# New tokens a single request may ask for (the UI's spin box and the CLI share it).
MAX_NEW_TOKENS = 4096

# Tokens of the target's greedy continuation per probe prompt of the draft check (20 probes). On a
# 2-core CPU with llama.cpp the continuations cost about 0.13 s a token: 48 a probe took 126 s there,
# past the check's 2 minutes; a GPU decodes them in seconds (docs/check.md).
PROBE_TOKENS = 40
