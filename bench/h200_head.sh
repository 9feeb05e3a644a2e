#!/usr/bin/env bash
# The draft head on the H200 (issue 11). Run from the project root on the GPU machine once the
# default target is a bf16 folder at /root/hf/target. Three device calls on one warm machine:
#   bench/h200_head.sh train     # call 1: data + training (~9 min), exports the head so far to $OUT
#   bench/h200_head.sh train     # call 2, the same command: resumes, trains to the end (~9 min), exports
#   bench/h200_head.sh bench     # call 3: head vs standard, greedy and T = 0.7, 20 prompts x 256 (~4 min)
#   bench/h200_head.sh once      # instead of the two train calls: data + training in one call (8.6 min budget)
# The work folder (/root/head-work) survives between calls while the machine stays warm. If it went
# cold after call 1, do not repeat `train` (it would spend the new call on data again): keep call 1's
# head, or run `once` with a fresh work folder. For the bench after a cold start, commit the returned
# files to assets/heads/qwen2.5-coder-1.5b-instruct/ first and pass HEAD=auto. Files returned: head-0000N-of-0000M.safetensors (<= 15 MiB each), manifest.json,
# train_log.jsonl, distill.json (train); h200_head.json (bench).
set -u -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false SPECDEC_CACHE_DIR=/tmp/specdec-cache
OUT=${OUT:-out}; mkdir -p "$OUT"
T=${TARGET:-/root/hf/target}
WORK=${WORK:-/root/head-work}
MINUTES=${MINUTES:-17.5}  # the whole budget of both training calls (data, training, export)
case "${1:-}" in
once)
  rm -rf "$WORK"
  MINUTES=8.6 exec "$0" train
  ;;
train)
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null
  timeout 585 python3 -m app.cli distill --target "$T" --out "$WORK/head" --work "$WORK/run" \
      --minutes "$MINUTES" --call-minutes 8.9 > "$OUT/distill.json"
  echo "distill exit code $?"; tail -c 1500 "$OUT/distill.json"
  cp "$WORK"/head/*.safetensors "$WORK"/head/manifest.json "$WORK"/head/train_log.jsonl "$OUT"/ 2>/dev/null
  grep '"kind": "eval"' "$WORK/run/train_log.jsonl" | tail -3
  ls -la "$OUT"
  ;;
bench)
  HEAD_DIR=${HEAD:-$WORK/head}
  # The head's CUDA graphs against its eager path, on a tiny model (~30 s, trains a tiny head on the CPU).
  timeout 120 python3 -m pytest tests/test_heads.py -m gpu -q -p no:cacheprovider 2>&1 | tail -2
  timeout 570 python3 bench/h200_head.py --target "$T" --head "$HEAD_DIR" --out "$OUT" 2>&1 \
    | grep -v -E "it/s\]|Loading weights"
  ;;
*)
  echo "usage: bench/h200_head.sh train|once|bench" >&2; exit 2
  ;;
esac
