#!/usr/bin/env bash
# GPU checks of the foundation issue, for a machine with 2 GPUs (NCCL).
# Usage: bash benchmarks/gpu_foundation.sh [LOGDIR]   (logs go to LOGDIR, default /tmp/eplb-gpu)
set -u
cd "$(dirname "$0")/.."
O=${1:-${OUT:-/tmp/eplb-gpu}}; mkdir -p "$O"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$O/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$O/gpus.txt"
echo "== 1. eplb demo on 2 GPUs, fp32, synthetic drifting load, --verify"
python3 -m eplb.ops.cli demo --device cuda --steps 300 --verify --json "$O/demo_cuda.json" 2>&1 | tee "$O/demo_cuda.log"
echo "== 2. eplb demo on 2 GPUs, bf16, ESFT trace replay, larger experts, --verify"
python3 -m eplb.ops.cli demo --device cuda --dtype bfloat16 --trace esft --experts 64 --top-k 6 --layers 8 \
  --hidden 1024 --intermediate 1024 --tokens 4096 --steps 200 --rebalance-interval 50 --verify \
  --json "$O/demo_cuda_bf16.json" 2>&1 | tee "$O/demo_cuda_bf16.log"
echo "== 3. the same job under plain torchrun"
python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m eplb.ops.demo --device cuda --steps 60 \
  --rebalance-interval 20 --verify 2>&1 | tee "$O/torchrun.log"
echo "== 4. multi-rank tests on NCCL"
EPLB_TEST_BACKEND=nccl python3 -m pytest -q -p no:cacheprovider tests/test_runtime.py \
  tests/test_transfer_dist.py tests/test_moe.py tests/test_weighted.py tests/test_control.py \
  tests/test_metrics.py 2>&1 | tee "$O/pytest_nccl.log"
