#!/usr/bin/env bash
# One batched call on the 2xH200 machine (see ../shared/GPU.md): unpack the carried bundles, run
# the GPU tests, the engine and KV-transfer benchmarks and a short end-to-end PD-vs-colocated
# run on a 4-layer Llama-3-shaped model. Logs go under $OUT. Carry: .whl and pdserve/v1.
set -u
OUT=${OUT:-/tmp/pdserve-out}
mkdir -p "$OUT" /tmp/site
for f in .whl/*.tar.xz; do tar xJf "$f" -C /tmp/site || exit 1; done
export PYTHONPATH=$PWD:/tmp/site FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a \
  PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false \
  PDSERVE_REDIS_SERVER=/tmp/site/redis_server/bin/redis-server PDSERVE_CACHE_DIR=/tmp/pdcache
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python -c "import torch, ray, grpc, redis, flashinfer, nixl; print('torch', torch.__version__, 'ray', ray.__version__, 'grpc', grpc.__version__, 'gpus', torch.cuda.device_count())"
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== rc=$? $name"
  tail -n "${TAILN:-30}" "$OUT/$name.log"
}
# build flashinfer's fused layer-ops kernels (norm, RoPE, SiLU) once, in parallel, into /tmp/fiws:
# ~1-2 min on a fresh machine; every later process (tests, benchmarks, workers) loads them
step jit_warm 240 python -c "import logging, time; logging.basicConfig(level=logging.INFO); \
t = time.time(); from engine.layer_ops import FlashInferOps; FlashInferOps().build_kernels(); \
print(f'fused layer-ops kernels ready in {time.time() - t:.0f} s')"
step gpu_tests 170 python -m pytest tests/gpu -q -rA -p no:cacheprovider
step bench_engine 170 python benchmarks/bench_engine.py
step bench_kv 80 python benchmarks/bench_kv_transfer.py --gpu --skip-redis
python -m deploy.cli make-model /tmp/small --preset llama3-8b --layers 4 --device cuda > "$OUT/make_small.log" 2>&1
step e2e 190 python benchmarks/bench_goodput.py --model /tmp/small --out "$OUT/e2e" \
  --workloads balanced --rates "balanced=4" --duration 5
