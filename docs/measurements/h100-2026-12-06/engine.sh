#!/usr/bin/env bash
# transformers' continuous-batching engine serving a Llama 3.2 1B-shaped model (4 layers, bf16, random weights)
# on two ranks time-slicing one GPU (NCCL >= 2.30 carried), replicated and sharded on the same arrivals:
#   engine.sh SHARE OUTDIR SECONDS   # SHARE: the replicated KV pool's share of the budget (0.05: the pool
#                                    # limits; 0.6: it does not; a list runs each). RATES (default 2,4) and
#                                    # REQUESTS (default 100 per rank) from the environment.
# Tokens were checked equal by the earlier run (../h200-2026-12-06/); --no-check here.
set -uo pipefail
share=$1 out=$2 limit=$3
export WSHARDING_NCCL_LIBRARY=${WSHARDING_NCCL_LIBRARY:-/tmp/nccl/libnccl.so.2} NCCL_MULTI_RANK_GPU_ENABLE=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=.:/tmp/site
rates=${RATES:-2,4} requests=${REQUESTS:-100}
tag="kv${share}_rate${rates}"; tag=${tag//./p}; tag=${tag//,/-}  # the device returns no file with a comma in its name
name="$out/bench_serve_engine_llama-1b-4l_2ranks-1gpu_$tag"
timeout "$limit" python3 -m wsharding bench serve --engine transformers --ranks 2 --hf-model llama-1b --layers 4 \
    --kv-share "$share" --prompt 64:512 --output 64:256 --requests "$requests" --rate "$rates" --trials 1 \
    --slo ttft=2000,tpot=200 --no-check --json "$name" > "$name.txt" 2>&1
rc=$?
echo "engine.sh $share: exit $rc after ${SECONDS} s" | tee -a "$name.txt"
tail -40 "$name.txt"
