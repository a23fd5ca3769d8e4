#!/usr/bin/env bash
# Everything localmoe checks on a GPU, in one call of a lent machine (~5 of its 15 minutes):
#   1. the CUDA cases of every Triton kernel test (tests/kernels: each kernel against its PyTorch
#      reference on cuda) and of the GPU tier (tests/paging/test_gpu_tier.py and the Triton path of
#      tests/kernels/test_gpu_tier_triton.py on cuda:0);
#   2. benchmarks/kernels.py --gpu-only: the Triton MXFP4 GEMV's bytes/s over the device's copy
#      bandwidth and the KDA kernels' tokens/s (the figures issue #8 asks for);
#   3. decode of a generated gpt-oss `small` packed store with a RAM tier of 25% of its experts,
#      without and with a GPU tier (--gpu-mem), with --stats: tokens/s and where experts ran.
# Logs go to $OUT (or the first argument).
#
# The device image has torch, triton, transformers, numpy, xxhash, ... but not gguf. Before the
# call, here in the repo root (pure-Python wheel; .whl is git-ignored through .git/info/exclude):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0
# then: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -o pipefail
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
# localmoe.kernels / localmoe.ui are the top-level kernels/ and ui/ (setup.py's package map): links do
# the same without installing anything (the image's own packages cover the rest)
[ -e localmoe/kernels ] || ln -s ../kernels localmoe/kernels
[ -e localmoe/ui ] || ln -s ../ui localmoe/ui
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import localmoe.kernels.mxfp4_moe, gguf" || { echo "localmoe does not import here"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

echo "== 1. CUDA tests"
python3 -m pytest -q -p no:cacheprovider -k "cuda" tests/kernels tests/paging/test_gpu_tier.py \
  tests/paging/test_metrics_placement.py 2>&1 | tee "$out/tests.log" | tail -25

echo "== 2. GPU kernel figures"
python3 benchmarks/kernels.py --gpu-only 2>&1 | tee "$out/kernels.log"

echo "== 3. GPU tier decode (gpt-oss small, RAM tier 25% of the experts)"
work=/tmp/gpu_check_model
python3 -m localmoe.testing gpt_oss "$work/src" --size small --seed 0 > /dev/null \
  && python3 -m localmoe convert "$work/src" "$work/store" > /dev/null 2>&1 || { echo "model setup failed"; exit 1; }
for gpu in 0 4G; do
  echo "-- --gpu-mem $gpu"
  python3 -m localmoe run "The capital of France is" -m "$work/store" --ram 25% --gpu-mem "$gpu" \
    --max-tokens 32 --temperature 0 --stats 2>&1 | tee -a "$out/tier.log" | tail -4
done
