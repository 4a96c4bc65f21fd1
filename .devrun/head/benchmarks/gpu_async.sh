#!/usr/bin/env bash
# GPU checks of the asynchronous rebalance (issue 4) for a machine with 2 GPUs (NCCL):
# end-to-end step times with a rebalance in flight (planner in a child process, and in the
# rebalance thread for comparison), NCCL tests of the async runtime, the transports and the
# CUDA-graph path, synchronous EPLB, and the transfer bandwidth.
# Usage: bash benchmarks/gpu_async.sh [LOGDIR] [PARTS]
#   LOGDIR default $OUT or /tmp/eplb-gpu-async; PARTS any of "e2e tests sync bw" (default all)
set -u
cd "$(dirname "$0")/.."
O=${1:-${OUT:-/tmp/eplb-gpu-async}}; mkdir -p "$O"
PARTS=${2:-e2e tests sync bw}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$O/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$O/gpus.txt"
if [[ " $PARTS " == *" e2e "* ]]; then
  echo "== 1. e2e, EPLB rebalancing in the background (async), static and oracle beside it"
  timeout 200 python3 benchmarks/e2e.py --mode async --watchdog 150 --json "$O/e2e_async.json" 2>&1 | tee "$O/e2e_async.log"
  echo "== 1b. the same EPLB run with the planner in the rebalance thread (comparison)"
  timeout 150 python3 benchmarks/e2e.py --mode async --modes eplb --planner thread --watchdog 120 \
    --json "$O/e2e_async_thread.json" 2>&1 | tee "$O/e2e_async_thread.log"
fi
if [[ " $PARTS " == *" tests "* ]]; then
  echo "== 2. NCCL tests: async runtime (NCCL and CUDA IPC), runtime, transports, CUDA graphs, planner process"
  EPLB_TEST_BACKEND=nccl timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_async.py \
    tests/test_runtime.py tests/test_transfer_gpu.py tests/test_cuda_graph.py tests/test_planner_process.py \
    2>&1 | tee "$O/pytest_nccl.log"
fi
if [[ " $PARTS " == *" sync "* ]]; then
  echo "== 3. e2e, synchronous EPLB only"
  timeout 120 python3 benchmarks/e2e.py --mode sync --modes eplb --json "$O/e2e_sync.json" 2>&1 | tee "$O/e2e_sync.log"
fi
if [[ " $PARTS " == *" bw "* ]]; then
  echo "== 4. transfer bandwidth, default (1 GiB messages) and IPC"
  timeout 150 python3 benchmarks/transfer_bw.py --chunks 1G 2>&1 | tee "$O/transfer_bw.log"
fi
