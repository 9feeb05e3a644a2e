#!/usr/bin/env bash
# The H200 benchmark session (issue: GPU fast path). Run from the project root on the GPU machine
# after the default pair was converted to /root/hf/{target,draft} (see README, "Benchmarks").
# Each part fits one 10-minute device call:
#   bench/h200.sh main          # gpu tests; prompts.jsonl: standard, speculative, hf-static (compiled)
#   bench/h200.sh assisted [N]  # first N (20) of prompts.jsonl: standard, speculative, hf-assisted
#   bench/h200.sh edit          # edit-prompts.jsonl: n-gram and draft+n-gram against standard
#   bench/h200.sh auto          # issue 10, ~5 min: auto mode vs standard (20 x 256); n-gram K sweep + auto on the
#                               # edit prompts; a draft/n-gram sweep (8 x 128, T 0 and 0.7) checking predictions
# Try a part on the CPU first with tiny models (4 min here): .venv/bin/python -m tests.tiny /tmp/tiny, then
#   T=/tmp/tiny/target D=/tmp/tiny/draft N=16 PY=.venv/bin/python bench/h200.sh auto
set -u -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SPECDEC_CACHE_DIR=/tmp/specdec-cache
OUT=${OUT:-out}; mkdir -p "$OUT"
T=${T:-/root/hf/target} D=${D:-/root/hf/draft} N=${N:-256} PY=${PY:-python3}
B=($PY -m app.cli bench --target $T --draft $D --max-new-tokens $N)
S=($PY -m app.cli sweep --target $T --draft $D)
case "${1:-main}" in
main)
  python3 -m pytest tests/test_fast.py -m gpu -q -p no:cacheprovider 2>&1 | tail -3
  # The compiled fast path first; if inductor refuses, the plain CUDA-graph path.
  timeout 420 "${B[@]}" --prompts assets/bench_prompts.jsonl --modes standard,speculative,hf-static \
      --fast-path compiled --json "$OUT/h200_main.json" 2>&1 | grep -v -E "^W1130|it/s" | tail -40 \
    || timeout 150 "${B[@]}" --prompts assets/bench_prompts.jsonl --modes standard,speculative,hf-static \
      --json "$OUT/h200_main.json" 2>&1 | tail -40
  ;;
assisted)
  head -n "${2:-20}" assets/bench_prompts.jsonl > /tmp/first.jsonl
  "${B[@]}" --prompts /tmp/first.jsonl --modes standard,speculative,hf-assisted --json "$OUT/h200_assisted.json" 2>&1 | tail -30
  ;;
edit)
  for proposer in ngram draft+ngram; do
    "${B[@]}" --prompts assets/edit_prompts.jsonl --modes standard,speculative --proposer $proposer \
        --json "$OUT/h200_edit_${proposer/+/_}.json" 2>&1 | tail -12
  done
  ;;
auto)
  # 0. Any K sequence (0 included) is lossless on CUDA graphs with rounds queued ahead, and no launch syncs.
  $PY -m pytest tests/test_control.py -m gpu -q -p no:cacheprovider 2>&1 | tail -3
  # 1. The router on the 20 prompts, default fast path, greedy: auto (0.5B draft) against standard, K=5 for reference.
  timeout 240 "${B[@]}" --prompts assets/bench_prompts.jsonl --modes standard,auto,speculative --proposer draft --k 5 \
      --json "$OUT/h200_auto.json" 2>&1 | tail -16
  # 2. N-gram on the edit prompts: every fixed K against auto (the sweep's rows), greedy.
  timeout 150 "${S[@]}" --prompts assets/edit_prompts.jsonl --k 1,2,3,4,5,6,8 --temperature 0 --proposer ngram --auto \
      --max-new-tokens $N --out "$OUT/h200_edit_sweep" 2>&1 | tail -14
  # 3. Predicted against measured for every configuration: 8 prompts x 128 tokens, draft and n-gram, T 0 and 0.7.
  head -n 8 assets/bench_prompts.jsonl > /tmp/first8.jsonl
  timeout 240 "${S[@]}" --prompts /tmp/first8.jsonl --k 1,2,3,5,8 --temperature 0,0.7 --proposer draft,ngram --auto \
      --max-new-tokens $((N / 2)) --out "$OUT/h200_sweep" 2>&1 | tail -32
  ;;
esac
