#!/usr/bin/env bash
# The two-GPU runs that the open performance targets (issue #10) still need, each part sized for one
# device call (<= 600 s), its results written to $OUT under the names docs/measurements/ keeps (put them
# in docs/measurements/h200x2-DAY/ and add a line to docs/measurements/index.md):
#
#   bash research/gpu_probes/issue10_x2.sh PART DAY        # DAY as 2026-12-01
#
#   decode      bench step at 1, 16, 256 tokens/rank: eager and CUDA graph, plain and mapped, the issue
#               thread, lookahead vs off in 5 paired rounds, the planner's calls timed in the forwards
#               (split by call, the GPU wait apart): eager <= 1.10x the link floor, <= 10 us per layer
#   prefill     bench step at 2048 and 8192 tokens/rank, plain and mapped: <= 1.05x / 1.02x replicated
#   fsdp        the FSDP2 baseline and our plain sharding side by side, every size, 3 rounds
#   demo        wsharding demo (k3-like) with 7 rounds and the CUDA-graph decode: <= 1.15x and the
#               lookahead verdict (the slowest rank's ratio printed beside the mean's)
#   contention  the 8192-token profile with mapped views and the next-step prefetch, SM clocks and power
#   tests       the GPU tests of sharding, the hot path and the NCCL binding (two GPUs), with the loaded NCCL
#   tests2      the soak and faults, the draft prefetch, loading, KV cache and groups, the same way
#
# With NCCL >= 2.30 loaded (WSHARDING_NCCL_LIBRARY set to a carried libnccl.so.2), map_own_chunk="auto"
# maps and --mapped measures it; the image's NCCL 2.28.9 refuses --mapped (decode, prefill: rank 0 names
# the version needed), so carry 2.32.3 first. Run from the repository root on nvidia-h200-x2.
set -euo pipefail
part=${1:?PART: decode, prefill, fsdp, demo, contention, tests or tests2}
day=${2:?DAY, as 2026-12-01}
out=${OUT:?OUT: the folder whose files come back}
export PYTHONPATH=$PWD
step=(python3 -m wsharding.lab.bench step --model llama8b-blocks --comm nccl)
case $part in
  decode)
    timeout 580 "${step[@]}" --tokens 1,16,256 --mapped --issue-thread --graph --no-fsdp --repeats 5 \
      --json "$out/bench_step_h200x2_${day}_llama8b-blocks_decode" ;;
  prefill)
    timeout 580 "${step[@]}" --tokens 2048,8192 --mapped --no-fsdp --repeats 5 \
      --json "$out/bench_step_h200x2_${day}_llama8b-blocks_prefill" ;;
  fsdp)
    timeout 580 "${step[@]}" --tokens 1,16,256,2048,8192 --repeats 3 \
      --json "$out/bench_step_h200x2_${day}_llama8b-blocks_fsdp" ;;
  demo)
    timeout 580 python3 -m wsharding demo --comm nccl --graph --rounds 7 --figures '' \
      --json "$out/demo_k3-like_h200x2_${day}_graph-r7.json" ;;
  contention)
    OUT=$out timeout 580 torchrun --nproc-per-node 2 research/gpu_probes/contention.py 8192 mapped next clocks
    mv "$out/contention_probe.json" "$out/contention_probe_h200x2_${day}_8192_mapped-next-clocks.json" ;;
  tests)  # on one H200 these files took 5.5 min with NCCL 2.32.3: the rest is part tests2
    timeout 580 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/models/test_gpu_sharding.py \
      tests/accel/test_gpu_hotpath.py tests/accel/test_gpu_nccl.py | tee "$out/gpu_tests_h200x2_${day}.log" ;;
  tests2)
    timeout 580 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/lab/test_soak.py tests/lab/test_gpu_draft.py \
      tests/loading/test_gpu_loading.py tests/models/test_gpu_kv.py tests/core/test_gpu_groups.py | tee "$out/gpu_tests2_h200x2_${day}.log" ;;
  *)
    echo "unknown part $part: decode, prefill, fsdp, demo, contention, tests or tests2" >&2
    exit 2 ;;
esac
