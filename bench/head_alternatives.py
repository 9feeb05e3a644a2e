"""How often is the target's correction among the draft head's next-best tokens? (what a tree of drafts can win)

For each greedy speculative step with the shipped head (K = 5) that rejected a draft, checks
whether the token the target put there was among the head's next S tokens at that draft position
(S = 1, 2, 3, 5, 7): each such hit is one more token per forward for a tree with S alternatives
beside each draft (engine/runners/tree.py). Runs on the CPU with the real default pair (torch):

    flock /tmp/specdec-real.lock .venv/bin/python bench/head_alternatives.py --prompts 20 --max-new-tokens 48
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20, help="first N prompts of assets/bench_prompts.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=5)
    args = ap.parse_args()

    import torch

    from engine.decoding.head import HeadProposer
    from engine.assemble import engine_for_pair, load_pair_packed
    from engine.heads.runner import HeadRunner
    from engine.loadspec import LoadSpec
    from engine.types import GenerationRequest, Message, Sampling

    engine = engine_for_pair(load_pair_packed(LoadSpec(None, None, with_draft=False, head="auto")), LoadSpec())
    engine.set_tree(0)  # chains: the question is what a tree would have won
    ranked: list[list[int]] = []  # the head's best 8 draft rows at each position of the proposal in flight
    per_proposal: list[list[list[int]]] = []
    tail, propose = HeadRunner._tail, HeadProposer.propose

    def recording_tail(self, last):
        tail(self, last)
        ranked.append(torch.topk(self.last_logits, 8).indices.tolist())

    def recording_propose(self, k):
        ranked.clear()
        proposal = propose(self, k)
        per_proposal.append([[int(self.head.head.d2t[i]) for i in row] for row in ranked])
        return proposal

    HeadRunner._tail, HeadProposer.propose = recording_tail, recording_propose
    sizes = (1, 2, 3, 5, 7)
    hits = dict.fromkeys(sizes, 0)
    rejections = steps = tokens = 0
    lines = Path(__file__).resolve().parents[1].joinpath("assets/bench_prompts.jsonl").read_text("utf-8").splitlines()
    for line in lines[: args.prompts]:
        per_proposal.clear()
        request = GenerationRequest(messages=(Message("user", json.loads(line)["prompt"]),), mode="speculative",
                                    k=args.k, proposer="head", sampling=Sampling(temperature=0.0),
                                    max_new_tokens=args.max_new_tokens)
        for step, ranks in zip(list(engine.generate(request)), per_proposal):
            steps += 1
            tokens += step.new_tokens
            if step.accepted < len(step.proposed) and step.added is not None and step.accepted < len(ranks):
                rejections += 1
                row = ranks[step.accepted]  # best first: row[0] is the draft the target rejected
                for s in sizes:
                    hits[s] += step.added in row[1 : 1 + s]
    print(f"{steps} steps, {tokens} tokens ({tokens / max(steps, 1):.2f} per step), {rejections} rejections")
    print("share of rejections whose correction is among the head's next S tokens: "
          + ", ".join(f"S={s} {hits[s] / max(rejections, 1):.3f}" for s in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
