"""Two mapped shardings on one communicator (the draft tests' target + draft), 1 and 2 ranks on one
GPU: does the second one's cuMemMap fail? Prints what each run returned or raised."""
import sys

from wsharding.cluster import RankCluster
from wsharding.lab.tasks.model import model_equality


def main() -> None:
    ranks = int(sys.argv[1])
    orders = [("mapped", True), ("mapped", True)] if len(sys.argv) < 3 else [
        (w, w == "mapped") for w in sys.argv[2].split(",")]
    with RankCluster(ranks, backend="gloo" if ranks > 1 else "nccl", task_timeout=300,
                     env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"}) as c:
        for k, (name, mapped) in enumerate(orders):
            try:
                r = c.run(model_equality, "small", [[3] * ranks, [5] * ranks], comm="nccl", map_own_chunk=mapped)
                print(k, name, "ok", r[0]["max_abs_diff"], r[0]["map_own_chunk"], r[0]["resident_bytes"], flush=True)
            except Exception as e:  # noqa: BLE001
                print(k, name, "FAILED", str(e).splitlines()[-3:], flush=True)


if __name__ == "__main__":
    main()
