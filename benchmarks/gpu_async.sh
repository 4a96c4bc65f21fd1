#!/usr/bin/env bash
# GPU checks of the asynchronous rebalance (issue 4) for a machine with 2 GPUs (NCCL):
# end-to-end step times with a rebalance in flight, NCCL tests of the async runtime, the
# transport and the CUDA-graph path, and the transfer bandwidth.
# Usage: bash benchmarks/gpu_async.sh [LOGDIR]   (default $OUT or /tmp/eplb-gpu-async)
set -u
cd "$(dirname "$0")/.."
O=${1:-${OUT:-/tmp/eplb-gpu-async}}; mkdir -p "$O"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$O/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$O/gpus.txt"
echo "== 1. e2e, EPLB rebalancing in the background (async), static and oracle beside it"
timeout 200 python3 benchmarks/e2e.py --mode async --watchdog 150 --json "$O/e2e_async.json" 2>&1 | tee "$O/e2e_async.log"
echo "== 2. NCCL tests: async runtime, runtime, transports, CUDA graphs"
EPLB_TEST_BACKEND=nccl timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_async.py \
  tests/test_runtime.py tests/test_transfer_gpu.py tests/test_cuda_graph.py 2>&1 | tee "$O/pytest_nccl.log"
echo "== 3. e2e, synchronous EPLB only (the timing now waits for the compute stream only)"
timeout 120 python3 benchmarks/e2e.py --mode sync --modes eplb --json "$O/e2e_sync.json" 2>&1 | tee "$O/e2e_sync.log"
echo "== 4. transfer bandwidth, final default (1 GiB messages) and IPC"
timeout 150 python3 benchmarks/transfer_bw.py --chunks 1G 2>&1 | tee "$O/transfer_bw.log"
