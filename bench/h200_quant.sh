#!/usr/bin/env bash
# Issue 12 on the GPU machine (quantization, memory plan, split targets). Run from the project root.
#   bench/h200_quant.sh one     # nvidia-h200:    int8/nf4 default pair + random 14B/32B targets (~5 min)
#   bench/h200_quant.sh split   # nvidia-h200-x2: a random 32B target split over two GPUs (~3 min)
# The machine has accelerate and psutil but no bitsandbytes: carry its wheel in .whl/ (run's carry:
# [".whl"]); it is installed into /tmp/site, never into the system Python.
set -u -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SPECDEC_CACHE_DIR=/tmp/specdec-cache
OUT=${OUT:-out}; mkdir -p "$OUT"
export OUT
if ! python3 -c "import bitsandbytes" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "no bitsandbytes wheel in .whl/ (carry it)"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import bitsandbytes, accelerate, torch; print('bitsandbytes', bitsandbytes.__version__, 'accelerate', accelerate.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
case "${1:-one}" in
one)
  timeout 330 python3 bench/h200_quant.py --target /root/hf/target --draft /root/hf/draft 2>&1 \
    | grep -v -E "it/s\]|Warning|warn\(" | tail -60
  python3 -m pytest tests/test_quant.py tests/test_qwen3.py -m gpu -q -p no:cacheprovider 2>&1 | tail -3
  ;;
split)
  timeout 230 python3 bench/h200_split.py --target /root/hf/target --draft /root/hf/draft 2>&1 \
    | grep -v -E "it/s\]|Warning|warn\(" | tail -40
  python3 -m pytest tests/test_split.py tests/test_quant.py -m gpu -q -p no:cacheprovider 2>&1 | tail -3
  ;;
esac
