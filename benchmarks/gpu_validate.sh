#!/usr/bin/env bash
# One batched call on the GPU machine: unpack the carried bundles, then run the steps named on
# the command line (default: all of them, in this order). Logs go under $OUT, at most 8 files
# (the device tool's limit): one log per step, bulky outputs as one .tgz.
# Carry: .whl and pdserve/v1. The GPU machine has no internet and no ray, nixl, flashinfer,
# recent grpcio or redis-server, and a run may carry 64 MiB: .whl/ (git-ignored) holds them as
# slim .tar.xz bundles, unpacked into /tmp/site below.
#
#   jit      build flashinfer's fused layer-ops kernels once into /tmp/fiws (~1-2 min fresh)
#   tests    the GPU tests (tests/gpu)
#   engine   python -m benchmarks engine (decode/prefill vs the HBM and matmul floors)
#   enginestep  python -m benchmarks engine_step (LLMEngine.step(), overlap scheduling
#            on/off, vs the pure CUDA-graph decode at B=1/8/16/64; host profile of the step)
#   fp8      the FP8 GPU tests, then python -m benchmarks fp8 (bf16 vs FP8 weights, one run)
#   fp8t     the FP8 GPU tests alone
#   fp8big   python -m benchmarks fp8 --shape llama3-70b (FP8 dummy weights + FP8 KV)
#   int      the INT GPU tests, then python -m benchmarks int --tune (the Triton GEMMs' tilings
#            per M bucket, then bf16 vs INT8 W8A8 (Triton GEMM, fused) vs INT4 W4A16 (Triton,
#            tinygemm) projections: decode B=1/16/64, prefill, logits); ~10 min on a fresh card
#   int8x    INT8 alone (auto, Triton, fused) over batches 1-64 and prompts 512-4096: where
#            int8_linear.py's `auto_kernels` thresholds come from
#   int70    python -m benchmarks int --shape llama3-70b (INT4 Triton and tinygemm)
#   e2e70i4  the Llama-3-70B shape, INT4 W4A16 dummy weights (config.json declares the scheme),
#            one colocated worker on one GPU, two rates: client TPOT vs engine step
#   kv       python -m benchmarks kv_transfer --gpu (needs 2 GPUs for the VRAM->VRAM figure)
#   kvsame   the same between two processes on ONE GPU (the one-GPU PD pair's hand-off), with
#            UCX's default UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto, then the backend's default y
#   router   python -m benchmarks router on this host's CPUs (tiny model, CPU workers)
#   e2e1     the whole system on ONE GPU with a 4-layer Llama-3-shaped model: colocated (one
#            worker) and PD (prefill + decode sharing the GPU), engine step time vs client TPOT
#   e2e8b    as e2e1 with the full Llama-3-8B shape (random bf16 weights written here)
#   e2e2     the same model, PD (GPU0 + GPU1) vs colocated (two workers), needs 2 GPUs
#   e2e8d    the Llama-3-8B shape from its config alone (--load-format dummy: nothing written to
#            disk), colocated and PD on ONE GPU, bf16 KV: client TPOT vs engine step and batch;
#            each worker sizes its KV pool from its half of the card (gpu_memory_share)
#   e2e8d8   the same PD pair with an e4m3 KV pool (hand-off bytes and time vs e2e8d's bf16)
#   profile8b  pdserve profile of the Llama-3-8B shape (bf16, dummy weights): the GPU profile
#            the simulator's agreement with the trio runs is checked against ($OUT/*.json)
#   outliers python -m benchmarks step_outliers: every engine step of the profile's sequences
#            (finishing sequences, a lone one after a burst of aborts) timed, the slow ones'
#            phases, batch and torch.profiler table ($OUT/step_outliers.json)
#   trio_ph / trio_bal / trio_dh  issue 42's modes through the whole system on ONE GPU, one
#            workload each (prefill-heavy, balanced, decode-heavy): one colocated worker, the
#            one-GPU PD pair, one split worker; goodput at TPOT 20 and 40 ms (a call each)
#   tiercheck  the host tier's copies (engine/kv/block_mover.py): outliers at the default config,
#            the tier's GPU tests, and the copy bench (both layouts, scattered offload vs the
#            piecewise copies: copies, GB/s, host ms); ~4 min with jit on a fresh machine
#   hosttier the host KV tier: its GPU tests, python -m benchmarks host_tier copy
#            (onboard/offload GB/s vs a pinned copy) and chat (multi-turn sessions, Llama-3-8B
#            shape with dummy weights, one colocated worker, a 1536-block device pool, 24 closed
#            sessions: tier off, then on, each its own cluster)
#   lora     the LoRA GPU tests (CUDA-graph decode with adapters vs eager), then
#            python -m benchmarks lora (decode step at B=64 with 1/4/16 adapters vs base; loads)
#   attention python -m benchmarks attention: paged decode attention kernels (flashinfer,
#            Triton tile sweep) over e4m3 and bf16 pools against their KV-read floor
#   e2e70    the Llama-3-70B shape, FP8 dummy weights + e4m3 KV, one colocated worker on one
#            GPU, two rates: client TPOT vs engine step
#   split    the split worker: its GPU tests, split_goodput prefill-heavy and balanced sweeps
#            (colocated, the adaptive split, a fixed 32-SM split) and a load ramp with the
#            split over time (their JSON files and split-ramp.png in $OUT/split.tgz);
#            splitt: the tests alone, splitb: the benchmarks alone (each fits one call);
#            splitph / splitbal / splitramp: one of the three benchmarks
#   structured python -m benchmarks structured: the engine step with half the batch under a JSON
#            schema vs all free, B=1/16/64, Llama-3-8B shape (needs .whl/xgrammar-0.2.9.tar.xz:
#            scripts/gpu-bundle-xgrammar.sh; run `jit` first on a fresh machine); with
#            .whl/bench-tokenizer.tar.xz (scripts/make-bench-tokenizer.py) over its 128,000
#            tokens instead of the 512-token tokenizer
#   tp       NEEDS 2 GPUS (device kind nvidia-h200-x2; on fewer it skips what it cannot run and
#            says why): python -m benchmarks tp_gpu --parts handoff (hand-off GB/s per pair of
#            layouts 1->1, 1->2, 2->1, 2->2 and PP=2 prefill pp2tp1->pp1tp1, pp2tp1->pp1tp2
#            between VRAM pools over NIXL), tests/gpu/test_tp_gpu.py (NCCL,
#            CUDA graphs with the all-reduces inside), then python -m benchmarks tp_gpu --parts
#            decode (TP=1 vs TP=2 decode step of the Llama-3-8B shape vs its HBM floor). ~6 min
#            on a warm machine: on a fresh one run `jit` in a call of its own first
set -u
OUT=${OUT:-/tmp/pdserve-out}
mkdir -p "$OUT" /tmp/site
for f in .whl/*.tar.xz; do tar xJf "$f" -C /tmp/site || exit 1; done
export PYTHONPATH=$PWD:/tmp/site FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a \
  PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false \
  PDSERVE_REDIS_SERVER=/tmp/site/redis_server/bin/redis-server PDSERVE_CACHE_DIR=/tmp/pdcache
# the generated API modules are git-ignored: carry them (pdserve/v1), the GPU machine has no
# grpcio-tools to make them
ls pdserve/v1/serving_pb2.py >/dev/null 2>&1 || { echo "no generated stubs: carry pdserve/v1"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python -c "import torch, ray, grpc, redis, flashinfer, nixl; print('torch', torch.__version__, 'ray', ray.__version__, 'grpc', grpc.__version__, 'gpus', torch.cuda.device_count())"
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== rc=$? $name $(date +%T)"
  tail -n "${TAILN:-30}" "$OUT/$name.log"
}
small_model() {
  [ -f /tmp/small/config.json ] || python -m deploy.cli make-model /tmp/small --preset llama3-8b \
    --layers 4 --device cuda > "$OUT/make_small.log" 2>&1
}
config_model() {  # config.json and tokenizer of a preset, for --load-format dummy
  [ -f "/tmp/cfg-$1/config.json" ] || python -m deploy.cli make-model "/tmp/cfg-$1" --preset "$1" \
    --config-only > "$OUT/make_cfg_$1.log" 2>&1
}
# `gpu_validate.sh STEP... -- CMD ARGS`: run CMD last, in the same environment (log: cmd.log;
# time limit CMD_LIMIT seconds, default 300)
STEPS=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do STEPS="$STEPS $1"; shift; done
DASH=""; [ "${1:-}" = "--" ] && { DASH=1; shift; }
if [ -n "$DASH" ] && [ $# -eq 0 ]; then
  echo "gpu_validate.sh: '--' needs a command after it (nothing run)"; exit 2
fi
if [ -z "$STEPS" ] && [ $# -eq 0 ]; then STEPS="jit tests engine enginestep kv router e2e1 e2e8b e2e2"; fi
for s in $STEPS; do
  case $s in
  jit) step jit 240 python -c "import logging, time; logging.basicConfig(level=logging.INFO); \
t = time.time(); from engine.modeling.layer_ops import FlashInferOps; FlashInferOps().build_kernels(); \
print(f'fused layer-ops kernels ready in {time.time() - t:.0f} s')" ;;
  tests) step gpu_tests 280 python -m pytest tests/gpu -q -rA -p no:cacheprovider ;;
  engine) step bench_engine 170 python -m benchmarks engine ;;
  enginestep) TAILN=${TAILN:-40} step bench_engine_step 300 python -m benchmarks engine_step ;;
  fp8|fp8t) step fp8_tests 200 python -m pytest tests/gpu/test_fp8_gpu.py tests/gpu/test_fp8_fused_gpu.py -q -rA -p no:cacheprovider
    [ "$s" = fp8 ] && step bench_fp8 400 python -m benchmarks fp8 ;;
  attention) step bench_attention 240 python -m benchmarks attention --dtypes e4m3,bf16 \
    --kernels fi-tc,triton --block-n 64,128 --stages 2,3 --warps 4 --splits 1,2 \
    --kv-first 0,1 --prefetch 0,1 ;;
  int) step int_tests 200 python -m pytest tests/gpu/test_int_gpu.py -q -rA -p no:cacheprovider
    # the Triton GEMMs' tilings tuned first, then bf16 / INT8 Triton and fused / INT4 Triton
    # and tinygemm side by side (the torch ops and tinygemm-only prefill: measured, slower)
    TAILN=${TAILN:-90} step bench_int 380 python -m benchmarks int --tune --int4-large-m 32 \
      --int8-kernels auto,triton,fused --int4-kernels triton,tinygemm ;;
  int8x) TAILN=${TAILN:-70} step bench_int8_cross 300 python -m benchmarks int --tune \
      --int8-kernels auto,triton,fused --int4-kernels none --batches 1,4,8,16,32,64 \
      --prefill-tokens 512,1024,2048,4096 ;;  # where INT8's Triton GEMM and fused kernels cross
  int70) TAILN=${TAILN:-25} step bench_int_70b 300 python -m benchmarks int --shape llama3-70b \
      --iters 15 --int4-kernels triton,tinygemm ;;
  e2e70i4) [ -f /tmp/cfg-70b-int4/config.json ] || python -m deploy.cli make-model \
      /tmp/cfg-70b-int4 --preset llama3-70b --config-only --quantization int4 \
      > "$OUT/make_cfg_70b_int4.log" 2>&1
    step e2e70i4 420 python -m benchmarks goodput --model /tmp/cfg-70b-int4 --out /tmp/e2e70i4 \
    --load-format dummy --modes colocated --colocated-workers 1 --workloads balanced \
    --rates "balanced=1,2" --duration 8 --stop-below 0
    tar czf "$OUT/e2e70i4.tgz" -C /tmp e2e70i4 ;;
  fp8big) step bench_fp8_70b 300 python -m benchmarks fp8 --shape llama3-70b --iters 15 ;;
  kv) step bench_kv 80 python -m benchmarks kv_transfer --gpu --skip-redis ;;
  kvsame) UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto step bench_kvsame_auto 100 python -m benchmarks \
      kv_transfer --gpu --same-device --skip-redis
    step bench_kvsame 100 python -m benchmarks kv_transfer --gpu --same-device --skip-redis ;;
  router) step bench_router 170 python -m benchmarks router --rates 2,5,10 --requests 120 \
    --markdown ;;
  e2e1) small_model; step e2e1 300 python -m benchmarks goodput --model /tmp/small \
    --out /tmp/e2e1 --modes colocated,pd --colocated-workers 1 --gpu-fraction 0.5 \
    --num-kv-blocks 8192 --workloads decode_heavy,balanced \
    --rates "decode_heavy=2,8;balanced=2,8" --duration 8 --stop-below 0
    tar czf "$OUT/e2e1.tgz" -C /tmp e2e1 ;;
  e2e8b) [ -f /tmp/llama3-8b/config.json ] || python -m deploy.cli make-model /tmp/llama3-8b \
    --preset llama3-8b --device cuda > "$OUT/make_8b.log" 2>&1
    step e2e8b 420 python -m benchmarks goodput --model /tmp/llama3-8b \
    --out /tmp/e2e8b --modes colocated,pd --colocated-workers 1 --gpu-fraction 0.5 \
    --workloads balanced,prefill_heavy \
    --rates "balanced=2,4;prefill_heavy=2" --duration 8 --stop-below 0
    tar czf "$OUT/e2e8b.tgz" -C /tmp e2e8b ;;
  e2e2) small_model; step e2e2 190 python -m benchmarks goodput --model /tmp/small \
    --out /tmp/e2e2 --workloads balanced --rates "balanced=4" --duration 5
    tar czf "$OUT/e2e2.tgz" -C /tmp e2e2 ;;
  e2e8d|e2e8d8) config_model llama3-8b
    kv=auto; modes=colocated,pd; [ "$s" = e2e8d8 ] && { kv=fp8; modes=pd; }
    step "$s" 300 python -m benchmarks goodput --model /tmp/cfg-llama3-8b --out "/tmp/$s" \
    --load-format dummy --kv-cache-dtype "$kv" --modes "$modes" --colocated-workers 1 \
    --gpu-fraction 0.5 --workloads balanced --rates "balanced=2,4" \
    --duration 8 --stop-below 0
    tar czf "$OUT/$s.tgz" -C /tmp "$s" ;;
  profile8b) config_model llama3-8b  # issue 43's engine profile of the trio's model
    step profile8b 200 python -m deploy.cli profile "$OUT/profile-llama3-8b.json" \
    --model /tmp/cfg-llama3-8b --device cuda --dtype bfloat16 --load-format dummy ;;
  outliers) config_model llama3-8b  # issue 49's slow engine steps, every step timed
    TAILN=${TAILN:-200} step step_outliers 240 python -m benchmarks step_outliers \
    --model /tmp/cfg-llama3-8b --json "$OUT/step_outliers.json" ${OUTLIERS_ARGS:-} ;;
  trio_ph|trio_bal|trio_dh) config_model llama3-8b  # issue 42's table through the whole system
    # one GPU, one cluster per mode in turn: one colocated worker, the PD pair sharing the GPU,
    # one split worker (each sized from half the card); ~3-4 min per workload on a warm machine
    case $s in
      trio_ph) w=prefill_heavy r=4,6,8,10 slo="ttft:2000 tpot:40" tight="ttft:2000 tpot:20" ;;
      trio_bal) w=balanced r=8,12,16,20 slo="ttft:1000 tpot:40" tight="ttft:1000 tpot:20" ;;
      trio_dh) w=decode_heavy r=4,8,12 slo="ttft:1000 tpot:40" tight="ttft:1000 tpot:20" ;;
    esac
    # TRIO_RATES: another sweep (4 rates fit one call); TRIO_CHUNK: colocated's prefill chunk
    r=${TRIO_RATES:-$r}
    step "$s" 560 python -m benchmarks goodput --model /tmp/cfg-llama3-8b --out "/tmp/$s" \
    --load-format dummy --modes colocated,pd,split --colocated-workers 1 --gpu-fraction 0.5 \
    --workloads "$w" --rates "$w=$r" --duration 8 --stop-below 0 --slo "$slo" --tight-slo "$tight" \
    --colocated-budget "${TRIO_CHUNK:-0}"
    tar czf "$OUT/$s.tgz" -C /tmp "$s" ;;
  e2e70) config_model llama3-70b
    step e2e70 420 python -m benchmarks goodput --model /tmp/cfg-llama3-70b --out /tmp/e2e70 \
    --load-format dummy --quantization fp8 --kv-cache-dtype fp8 --modes colocated \
    --colocated-workers 1 --workloads balanced --rates "balanced=1,2" --duration 8 --stop-below 0
    tar czf "$OUT/e2e70.tgz" -C /tmp e2e70 ;;
  lora) step lora_tests 300 python -m pytest tests/unit/engine/test_lora.py tests/unit/engine/test_lora_triton.py -q -rA -p no:cacheprovider
    TAILN=${TAILN:-60} step bench_lora 300 python -m benchmarks lora
    # four slots (a cluster serving four adapters): the dense kernels read every slot
    TAILN=${TAILN:-30} step bench_lora4 200 python -m benchmarks lora --adapters 1,4 \
    --kernels triton-dot,triton-dot-serial,torch ;;
  tiercheck) config_model llama3-8b  # issue 49: the host tier's copies in bulk, checked
    TAILN=${TAILN:-200} step step_outliers 240 python -m benchmarks step_outliers \
    --model /tmp/cfg-llama3-8b --json "$OUT/step_outliers.json"
    step host_tier_tests 120 python -m pytest tests/gpu/test_host_tier_gpu.py -q -rA -p no:cacheprovider
    step host_tier_copy 120 python -m benchmarks host_tier copy --blocks 1024 --reps 5 --out /tmp/htc ;;
  hosttier) config_model llama3-8b
    step host_tier_tests 120 python -m pytest tests/gpu/test_host_tier_gpu.py -q -rA -p no:cacheprovider
    step host_tier_copy 90 python -m benchmarks host_tier copy --blocks 1024 --out /tmp/ht
    for t in off on; do step host_tier_chat_$t 300 python -m benchmarks host_tier chat \
      --model /tmp/cfg-llama3-8b --load-format dummy --tiers $t --out /tmp/ht; done
    tar czf "$OUT/host_tier.tgz" -C /tmp ht ;;
  tp) config_model llama3-8b  # the bench's exit: 0 ran (or skipped), 1 a check failed, 2 no GPU
    TAILN=${TAILN:-40} step tp_handoff 330 python -m benchmarks tp_gpu --parts handoff \
    --model /tmp/cfg-llama3-8b --part-timeout 100
    step tp_tests 200 python -m pytest tests/gpu/test_tp_gpu.py -q -rA -p no:cacheprovider
    TAILN=${TAILN:-30} step tp_decode 420 python -m benchmarks tp_gpu --parts decode \
    --model /tmp/cfg-llama3-8b --part-timeout 200 ;;
  structured) T=/tmp/site/bench-tokenizer-128k.json; [ -f $T ] || T=""
    TAILN=${TAILN:-20} step bench_structured 300 python -m benchmarks structured ${T:+--tokenizer $T} ;;
  split|splitt|splitb|splitph|splitbal|splitramp) config_model llama3-8b  # ~8 min warm
    G="python -m benchmarks split_goodput --model /tmp/cfg-llama3-8b --load-format dummy"
    mkdir -p /tmp/split
    case $s in split|splitt) step split_tests 120 python -m pytest tests/gpu/test_engine_gpu.py \
      -k split -q -rA -p no:cacheprovider ;; esac
    case $s in split|splitb|splitph) step split_ph 280 $G --workload prefill_heavy \
      --rates 6,8,10,12 --requests 64 --burst 8 --json /tmp/split/ph.json \
      --modes colocated:1024,colocated:2048,split:0,split:0@40 ;; esac
    case $s in split|splitb|splitbal) step split_bal 200 $G --workload balanced \
      --rates 16,24,32 --requests 120 --burst 0 --json /tmp/split/bal.json \
      --modes colocated:1024,colocated:2048,split:0,split:0@40 ;; esac
    case $s in split|splitb|splitramp) step split_ramp 90 $G --workload balanced \
      --modes split:0 --ramp 2:24:40 --json /tmp/split/ramp.json
      $G --plot-split /tmp/split/split-ramp.png --from /tmp/split/ramp.json > /dev/null 2>&1 ;; esac
    tar czf "$OUT/split.tgz" -C /tmp split ;;
  *) echo "unknown step $s"; exit 2 ;;
  esac
done
if [ $# -gt 0 ]; then TAILN=${TAILN:-80} step cmd "${CMD_LIMIT:-300}" "$@"; fi
