"""Where does the draft head's acceptance go between training and decoding?

Training reports the head's held-out acceptance teacher-forced (the target's features of a whole
answer, `engine.heads.train.greedy_acceptance`). Decoding measures it per draft position. This
script puts the two side by side on the same prompts and the same answers: for each prompt it
decodes with the engine (standard; greedy unless --temperature), then measures on that answer
  - teacher-forced acceptance with the training code's features (hooks on the HF model),
  - the same with the engine's runner features (the lean forward's kept rows),
  - the decoding's own per-position acceptance (a speculative run with the head, chains),
so a gap between the first two is a feature mismatch, between the last two a drafting-loop one,
and a gap to the training figure is the prompts.

With --temperature T it also prices three ways of drafting when sampling at T, teacher-forced per
draft position (the expected acceptance of one draft token, target p and head q both at T):
  sampled  sum(min(p, q))         the head samples from q, accepted with min(1, p/q)
  argmax   p(argmax q)            the head's greedy token, a point mass, accepted with p(x)
  top3     p(the head's top 3)    greedy token plus two alternatives in a tree (the target's
                                  sampled token is kept when it is any of them)
With --tree-bound it also bounds what a tree of drafts could win: teacher-forced, the draft at
step s is kept when the target's token is among the head's best b tokens there, for a full tree of
branching b (every node expanded by its b best tokens, b**K nodes); b = 1 is the chain. Tokens per
target forward = 1 + the run of kept steps (rows where all K steps exist).

CPU, real default pair and shipped head:

    flock /tmp/specdec-real.lock .venv/bin/python bench/head_acceptance_gap.py --prompts 20 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_record  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20, help="first N prompts of the prompt file")
    ap.add_argument("--prompt-file", default="assets/bench_prompts.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--target", default=None, help="a target folder (default: the packaged pair)")
    ap.add_argument("--head", default="auto")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--tree-bound", action="store_true", help="tokens per forward of full trees, teacher-forced")
    ap.add_argument("--temperature", type=float, default=0.0, help="also price sampled drafting at this T")
    args = ap.parse_args()

    import torch

    from engine.assemble import engine_for_pair, load_pair_packed
    from engine.heads.train import Teacher, greedy_acceptance, step_mask, unrolled_states
    from engine.loadspec import LoadSpec
    from engine.types import GenerationRequest, Message, Sampling

    from engine.errors import EngineError

    root = Path(__file__).resolve().parents[1]
    try:
        lines = root.joinpath(args.prompt_file).read_text("utf-8").splitlines()[: args.prompts]
        engine = engine_for_pair(load_pair_packed(LoadSpec(args.target, None, with_draft=False, head=args.head)),
                                 LoadSpec())
    except (EngineError, OSError) as e:
        print(f"head_acceptance_gap: {e}", file=sys.stderr)
        return 2
    if engine.head_runner is None:
        print("head_acceptance_gap: no draft head fits this target (--head DIR)", file=sys.stderr)
        return 2
    engine.set_tree(0)
    head = engine.head_runner.head
    depth = args.k
    teacher = Teacher(engine.target, head.config.feature_layers)
    lm_head = engine.target.get_output_embeddings()  # a module: on the CPU its weight is packed
    tf_hooks = [[0, 0] for _ in range(depth)]
    tf_runner = [[0, 0] for _ in range(depth)]
    decoded = [[0, 0] for _ in range(depth)]
    feature_diff = 0.0
    branchings = (1, 2, 3, 4)
    runs = {b: [0.0, 0] for b in branchings}  # sum of 1 + kept run, rows
    priced = {name: [[0.0, 0] for _ in range(depth)] for name in ("sampled", "argmax", "top3")}
    rows = []
    for line in lines:
        item = json.loads(line)
        messages = (Message("user", item["prompt"]),)
        sampling = Sampling(temperature=args.temperature)  # greedy unless --temperature (then answers are sampled)
        std = GenerationRequest(messages=messages, mode="standard", sampling=sampling, max_new_tokens=args.max_new_tokens)
        prompt = engine.encode(std)
        answer = [s.added for s in engine.generate(std) if s.added is not None]
        spec = GenerationRequest(messages=messages, mode="speculative", k=args.k, proposer="head", sampling=sampling,
                                 max_new_tokens=args.max_new_tokens)
        for step in engine.generate(spec):
            for i in range(len(step.proposed)):
                if i > step.accepted:
                    break
                decoded[i][1] += 1
                decoded[i][0] += i < step.accepted
        ids = torch.tensor([prompt + answer], device=engine.device)
        lengths = torch.tensor([ids.shape[1]], device=engine.device)
        prompt_lens = torch.tensor([len(prompt)], device=engine.device)
        with torch.no_grad():
            features, normed = teacher(ids, lengths)
            runner = engine.target_runner
            runner.reset()
            runner.prefill(ids[0])
            mine = runner.hidden[: ids.shape[1]].unsqueeze(0).to(features.dtype)
            runner.reset()
            feature_diff = max(feature_diff, float((mine - features).abs().max() / features.abs().max()))
            cos, sin = head.rope_tables(ids.shape[1] + depth + 1, engine.device, head.lm_rows.dtype)
            for feats, sink in ((features, tf_hooks), (mine, tf_runner)):
                hits, counts = greedy_acceptance(head, feats, normed, lm_head, ids, lengths, prompt_lens, depth, cos, sin)
                for i in range(depth):
                    sink[i][0] += hits[i]
                    sink[i][1] += counts[i]
        if args.tree_bound:
            with torch.no_grad():
                best = lm_head(normed[0]).argmax(-1)  # [T] the target's token after each position
                t = ids.shape[1]
                rows_ok = torch.arange(t) + 1 + depth <= t - 1
                rows_ok &= torch.arange(t) >= len(prompt) - 1
                alive = {b: torch.ones(t, dtype=torch.bool) for b in branchings}
                total = {b: torch.ones(t) for b in branchings}
                for step, h in enumerate(unrolled_states(head, features, ids, depth, cos, sin)):
                    top = head.d2t[head.logits(h[0]).topk(max(branchings), -1).indices]  # [T, 4] target ids
                    truth = best[(torch.arange(t) + 1 + step).clamp_max(t - 1)]  # [T]
                    for b in branchings:
                        alive[b] &= (top[:, :b] == truth[:, None]).any(-1)
                        total[b] += alive[b].float()
                for b in branchings:
                    runs[b][0] += float(total[b][rows_ok].sum())
                    runs[b][1] += int(rows_ok.sum())
        if args.temperature > 0:
            with torch.no_grad():
                full = lm_head(normed[0]).float()  # [T, V] the target's logits after each position
                states = unrolled_states(head, features, ids, depth, cos, sin)
                for step, h in enumerate(states):
                    r, c = step_mask(lengths, prompt_lens, ids.shape[1], step).nonzero(as_tuple=True)
                    q_small = torch.softmax(head.logits(h[r, c]).float() / args.temperature, -1)  # [N, Vd]
                    q = torch.zeros(len(c), full.shape[-1]).index_copy_(1, head.d2t, q_small)  # [N, V]
                    p = torch.softmax(full[c + 1 + step] / args.temperature, -1)  # [N, V]
                    top = q.topk(3, -1).indices  # [N, 3]
                    for name, value in (("sampled", torch.minimum(p, q).sum(-1)),
                                        ("argmax", p.gather(1, top[:, :1])[:, 0]),
                                        ("top3", p.gather(1, top).sum(-1))):
                        priced[name][step][0] += float(value.sum())
                        priced[name][step][1] += len(c)
        rows.append({"id": item.get("id"), "answer_tokens": len(answer)})
        print(f"{item.get('id')}: {len(answer)} tokens", flush=True)

    def rates(pairs):
        return [round(h / c, 4) if c else None for h, c in pairs]

    result = {
        "teacher_forced_hooks": rates(tf_hooks),
        "teacher_forced_runner": rates(tf_runner),
        "decoding_per_position": rates(decoded),
        "max_relative_feature_difference": round(feature_diff, 5),
        "prompts": len(lines), "max_new_tokens": args.max_new_tokens, "device": str(engine.device),
        "dtype": str(head.lm_rows.dtype),
    }
    if args.tree_bound:
        result["full_tree_tokens_per_forward"] = {f"b={b}": round(a / n, 3) if n else None for b, (a, n) in runs.items()}
    if args.temperature > 0:
        result["temperature"] = args.temperature
        result["drafting_at_temperature"] = {name: [round(a / n, 4) if n else None for a, n in steps]
                                             for name, steps in priced.items()}
    print(json.dumps(result, indent=1))
    if args.json:
        write_record(Path(args.json), vars(args), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
