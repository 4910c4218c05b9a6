#!/usr/bin/env bash
# The serving benchmark's pair runs on one GPU with two ranks time-slicing it (NCCL >= 2.30 carried,
# see ../../../shared/GPU.md or scripts/): one budget per call, the same set-up otherwise, so that
# `wsharding bench serve --from-json` merges them into one report with the crossover.
#   run.sh kv OUTDIR SECONDS     # 8.5 GiB per rank: the replicated pool limits (token check on)
#   run.sh compute OUTDIR SECONDS  # 10 GiB per rank: neither pool limits at these rates (no token check)
#   run.sh kv-steady OUTDIR SECONDS  # 8.5 GiB, 150 requests at 4 and 6/s: long enough to be steady (tokens
#                                    # were checked by the kv run)
#   run.sh compute-steady OUTDIR SECONDS  # 10 GiB, the same 150 requests at 4 and 6/s: neither pool limits;
#                                         # --from-json with kv-steady gives both regimes and the crossover
set -uo pipefail
which=$1 out=$2 limit=$3
export WSHARDING_NCCL_LIBRARY=${WSHARDING_NCCL_LIBRARY:-/tmp/nccl/libnccl.so.2} NCCL_MULTI_RANK_GPU_ENABLE=1 PYTHONPATH=.
setup=(--ranks 2 --preset k3-like --prompt 64:512 --output 128:256 --token-budget 256 --requests 60
       --rate 2,4,8 --trials 1 --slo ttft=2000,tpot=200 --predict)
case $which in
  kv) extra=(--budget-gib 8.5) ;;
  compute) extra=(--budget-gib 10 --no-check) ;;
  kv-steady) extra=(--budget-gib 8.5 --no-check --requests 150 --rate 4,6) ;;
  compute-steady) extra=(--budget-gib 10 --no-check --requests 150 --rate 4,6) ;;
  *) echo "run.sh: kv, compute, kv-steady or compute-steady, not $which" >&2; exit 2 ;;
esac
timeout "$limit" python3 -m wsharding bench serve "${setup[@]}" "${extra[@]}" --json "$out/bench_serve_k3-like_2ranks-1gpu_$which" \
    > "$out/bench_serve_k3-like_2ranks-1gpu_$which.txt" 2>&1
rc=$?
echo "bench serve $which: exit $rc after ${SECONDS} s" | tee -a "$out/bench_serve_k3-like_2ranks-1gpu_$which.txt"
tail -45 "$out/bench_serve_k3-like_2ranks-1gpu_$which.txt"
