#!/usr/bin/env bash
# The H200 benchmark session (issue: GPU fast path). Run from the project root on the GPU machine
# after the default pair was converted to /root/hf/{target,draft} (see README, "Benchmarks").
# Each part fits one 10-minute device call:
#   bench/h200.sh main          # gpu tests; prompts.jsonl: standard, speculative, hf-static (compiled)
#   bench/h200.sh assisted [N]  # first N (20) of prompts.jsonl: standard, speculative, hf-assisted
#   bench/h200.sh edit          # edit-prompts.jsonl: n-gram and draft+n-gram against standard
set -u -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SPECDEC_CACHE_DIR=/tmp/specdec-cache
OUT=${OUT:-out}; mkdir -p "$OUT"
T=/root/hf/target D=/root/hf/draft
B=(python3 -m app.cli bench --target $T --draft $D --max-new-tokens 256)
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
esac
