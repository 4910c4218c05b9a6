#!/usr/bin/env bash
# Every GPU test file, on the GPU machine, in three streams run side by side (most of a GPU test's time
# is rank start-up, imports and waits, not the GPU: three streams cut the device time a session spends
# on them), then the NCCL round trip alone: it counts the device's free memory, which the other streams
# move. Logs: $OUT/gpu_tests_{core,serve,engine,roundtrip}.log, one line per test (a stream stopped by its
# limit still shows what ran). Run from the repository root:
#   bash scripts/gpu_tests.sh [SECONDS]        # each stream is stopped after SECONDS (default 420)
# Carry NCCL >= 2.30 for the tests of several ranks on one GPU (WSHARDING_NCCL_LIBRARY; they skip,
# saying why, without it) and, for the engine's tests, the wheels of transformers 5.2x and what it needs
# beyond the machine's image in .whl/ (installed into /tmp/site, never into the image's python).
set -uo pipefail
limit=${1:-420}
out=${OUT:-reports}
mkdir -p "$out"
export NCCL_MULTI_RANK_GPU_ENABLE=1 PYTHONUNBUFFERED=1 PYTHONPATH=.
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=.:/tmp/site
fi
core=(tests/models/test_gpu_sharding.py tests/accel/test_gpu_nccl.py tests/accel/test_gpu_hotpath.py
      tests/core/test_gpu_groups.py tests/core/test_cluster_lifecycle.py tests/core/test_verify_replicas.py
      tests/serve/test_gpu_step_graphs.py tests/lab/test_gpu_serve_graphs.py)
serve=(tests/lab/test_gpu_serve.py tests/lab/test_gpu_predict.py tests/lab/test_gpu_draft.py
       tests/lab/test_gpu_loading.py tests/lab/test_soak.py)
engine=(tests/lab/test_gpu_kv.py tests/lab/test_gpu_engine_serve.py)
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$out/gpu_tests_machine.txt"
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.nccl.version())" \
    | tee -a "$out/gpu_tests_machine.txt"
run() {
    timeout "$limit" python3 -m pytest -m gpu -v -rs -p no:cacheprovider --durations=10 "${@:2}" >"$out/gpu_tests_$1.log" 2>&1
    echo "gpu_tests $1: exit $? after ${SECONDS} s" >>"$out/gpu_tests_$1.log"
}
run core "${core[@]}" &
run serve "${serve[@]}" &
run engine "${engine[@]}" &
wait
run roundtrip tests/lab/test_gpu_nccl_roundtrip.py
for stream in core serve engine roundtrip; do
    echo "==== $stream"
    grep -E "FAILED|ERROR|SKIPPED \[|[0-9]+ (passed|failed)|exit" "$out/gpu_tests_$stream.log" | tail -25
done
