#!/usr/bin/env bash
# The GPU checks as one script, for a lent GPU machine that has torch and no network
# (docs/results.md, "On a GPU"): the CUDA tests, then `starqa bench` exact against top-k at 8K, 32K
# and 128K on a model of SmolLM2's shape with random weights. Run from the repository root
# with, beside it (git-ignored, taken along):
#   .whl/             wheels of what that machine lacks (faiss-cpu, gguf, pathspec, ...)
#   .devcarry/smollm2 SmolLM2's config and tokenizer: python benchmarks/random_model.py \
#                     ~/.cache/starqa/models/smollm2-135m /tmp/x --tiny-copy .devcarry/smollm2
# Logs go to $OUT (default /tmp/cuda-check).
set -o pipefail
OUT=${OUT:-/tmp/cuda-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# starqa's CPU kernels, as `pip install` builds them (starqa/native/build.py: setup.py's
# sources and flags): on a GPU, ivf and flat on disk rank on the host with them; without a
# compiler, numpy's path
python3 -m starqa.native.build --no-werror "starqa/native/_attend$(
    python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" \
    || echo "no C compiler: starqa's kernels not built"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, faiss; from starqa.native import ops as native; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'faiss', faiss.__version__, 'kernels', native.available())"
  lscpu | grep -E 'Model name|^CPU\(s\)'; } 2>&1 | tee "$OUT/machine.txt"
timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 \
    | tee "$OUT/tests.log"
python3 benchmarks/random_model.py .devcarry/smollm2 /tmp/smollm2-random >"$OUT/model.log" 2>&1 \
    || { tail "$OUT/model.log"; exit 1; }
STARQA_HOME=/tmp/starqa-home timeout "${BENCH_SECONDS:-300}" python3 -m starqa bench \
    --methods star --workers 1 --lengths "${LENGTHS:-8k,32k,128k}" --new-tokens 16 \
    --top-k 1% --index flat,ivf --kv-on-disk --device cuda --model /tmp/smollm2-random \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
