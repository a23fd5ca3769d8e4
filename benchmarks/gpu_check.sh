#!/usr/bin/env bash
# Everything localmoe checks on a GPU, in one call of a lent machine (5-8 of its 15 minutes; every
# step has its own timeout, 460 s in all, so the whole stays under 8 minutes):
#   1. the CUDA cases of every kernel test (tests/kernels: each Triton kernel and fla's KDA / Gated
#      DeltaNet against the PyTorch references; the MXFP4 wrapper under sync debug mode "error" and
#      captured in a CUDA graph; the GPU tier through Triton) and of the GPU tier (tests/paging);
#   1b. tiny models built on CUDA (the dense Llama, gpt-oss, Kimi K3: weights and caches on the device,
#      tests/engine/test_device.py) against the same models on the CPU, logits of a prefill and 8 decode steps;
#   2. benchmarks/kernels.py --gpu-only (benchmarks/gpu_kernels.py): the MXFP4 grouped GEMV's bytes/s
#      over the device's copy bandwidth at N = 1, 4, 16 rows per expert, kernel alone and through
#      localmoe.kernels.mxfp4_moe.mxfp4_grouped, torch bf16 bmm beside it; KDA / Gated DeltaNet
#      tokens/s of the dispatcher, of fla and of our Triton; a SUMMARY block with each figure beside
#      its goal (issue 22);
#   3. decode of a generated gpt-oss `small` packed store with a RAM tier of 25% of its experts,
#      without and with a GPU tier (--gpu-mem), with --stats: tokens/s and where experts ran.
# Logs go to $OUT (or the first argument); the last lines printed are the summaries.
#
# The device image has torch, triton, transformers, numpy, xxhash, ... but not gguf, fla-core (the
# `gpu` extra: pure-Python wheel) or perhaps einops (fla's one dependency, pure Python). Before the
# call, here in the repo root (.whl is git-ignored through .git/info/exclude):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0 fla-core==0.6.0 einops==0.8.2
# then: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -o pipefail
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
started=$(date +%s)
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
python3 -c "from localmoe.kernels.kda import fla_ops; import fla; print('fla-core', fla.__version__, 'ops:', fla_ops.ops() is not None)" \
  || echo "fla-core missing: KDA / GDN run our Triton kernels, fla's figures are left out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

echo "== 1. CUDA tests"
timeout 160 python3 -m pytest -q -p no:cacheprovider -k "cuda" tests/kernels tests/paging/test_gpu_tier.py \
  tests/paging/test_metrics_placement.py tests/store/test_ggml_iq.py 2>&1 | tee "$out/tests.log" | tail -25

echo "== 1b. models on CUDA against the CPU"
timeout 50 python3 -m pytest -q -p no:cacheprovider -k "cuda" tests/engine/test_device.py 2>&1 \
  | tee "$out/device.log" | tail -8

echo "== 2. GPU kernel figures"
timeout 140 python3 benchmarks/kernels.py --gpu-only 2>&1 | tee "$out/kernels.log"

echo "== 3. GPU tier decode (gpt-oss small, RAM tier 25% of the experts)"
work=/tmp/gpu_check_model
timeout 25 python3 -m localmoe.testing gpt_oss "$work/src" --size small --seed 0 > /dev/null \
  && timeout 25 python3 -m localmoe convert "$work/src" "$work/store" > /dev/null 2>&1 || echo "model setup failed"
for gpu in 0 4G; do
  echo "-- --gpu-mem $gpu"
  timeout 30 python3 -m localmoe run "The capital of France is" -m "$work/store" --ram 25% --gpu-mem "$gpu" \
    --max-tokens 32 --temperature 0 --stats 2>&1 | tee -a "$out/tier.log" | tail -4
done
echo "== done in $(( $(date +%s) - started )) s; tests: $(tail -1 "$out/tests.log"); models: $(tail -1 "$out/device.log")"
