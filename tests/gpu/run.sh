#!/usr/bin/env bash
# Every GPU check of torchpass in one go, on one GPU, in under 10 minutes:
#   CUDA tensor capture/restore and CUDA RNG (bitwise), pinned staging throughput against a bare cudaMemcpy,
#   a 4-process DDP job on one GPU (gloo carries CUDA tensors) migrating a SIGKILLed rank bitwise,
#   an NCCL world of one aborted and rebuilt under the same group object (timed), an NCCL peer stuck in
#   SIGSTOP released by abort (where NCCL has NCCL_MULTI_RANK_GPU_ENABLE), and the real NVML health watch.
# Usage: tests/gpu/run.sh [OUT_DIR]   (figures: OUT_DIR/*.json, staging.jsonl; log: gpu.log; junit.xml)
# Runs from a checkout where torchpass is installed (pip install -e ".[test]"), or links the checkout as
# the torchpass package when it is not; wheels in .whl/ (hydra-core, omegaconf, crc32c, ...) are installed
# first when a machine has no package index.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-$(mktemp -d)}}
mkdir -p "$out"
export TORCHPASS_GPU_OUT=$out PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/torchpass-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/torchpass-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import torchpass.core" 2>/dev/null; then
    mkdir -p /tmp/torchpass-pkg && ln -sfn "$PWD" /tmp/torchpass-pkg/torchpass
    export PYTHONPATH=/tmp/torchpass-pkg:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee "$out/env.txt"
timeout 420 python3 -m pytest tests/gpu -v -rA -p no:cacheprovider --timeout 240 --junitxml "$out/junit.xml" 2>&1 | tee "$out/gpu.log"
