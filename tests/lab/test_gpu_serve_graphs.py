"""``wsharding bench serve --graphs`` on a GPU (marker ``gpu``; skipped without CUDA): decode steps of
both variants replayed from CUDA graphs captured on each variant's pool, or both variants eager with
the reason, said once.

* One rank (world size 1: its gathers are copies, and capture): ``--graphs on``; the sharded model's
  replay of the replicated run -- both through their graphs -- gives every token, and each variant
  replayed steps in its measured trials and in the replay, the same shapes captured for both.
* Two ranks that cannot capture their gathers (two time-slicing one GPU -- our NCCL, NCCL >= 2.30 in
  ``WSHARDING_NCCL_LIBRARY`` and ``NCCL_MULTI_RANK_GPU_ENABLE=1``; on two GPUs the ranks gather with
  torch.distributed, which does not capture): ``--graphs on`` is refused on every rank before anything
  is built; ``auto`` runs both variants eagerly and the report says why, in one line.

Run: ``PYTHONPATH=. python3 -m pytest -m gpu -q -s tests/lab/test_gpu_serve_graphs.py`` (well under a
minute on an H100). Imports no Jupyter stack (no figure is drawn: ``--json`` is not given).
"""

from __future__ import annotations

import pytest
import torch

from tests.lab.test_gpu_kv import _two_ranks
from wsharding.lab.bench.serve import format_table, run_serve_bench
from wsharding.lab.cluster import RemoteError
from wsharding.serve import Workload
from wsharding.serve.metrics import SLO

pytestmark = pytest.mark.gpu

WL = Workload(requests=6, prompt=(16, 64), output=(8, 24))
#: One budget, all at once, two trials: the second trial runs on the first one's pool, reset.
SETUP = {"kv_shares": [0.3], "rates": [None], "trials": 2, "token_budget": 32, "slo": SLO(ttft_ms=60_000, tpot_ms=60_000),
         "warmup": 1}


def test_gpu_bench_serve_graphs_on_one_rank_replays_both_variants_every_token_equal():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    report = run_serve_bench(1, "small", WL, comm="torch", graphs="on", **SETUP)
    print("\n" + format_table(report))
    assert report["graphs"] == {"mode": "on", "eager_reason": None}
    assert report["equal"] and report["differ"] == []  # the replay through graphs, token for token
    row = report["rows_by_budget"][0]
    shapes = {v: row[v]["graphs"]["shapes"] for v in report["variants"]}
    assert len(set(shapes.values())) == 1 and shapes["replicated"] > 0, shapes  # the same shapes for the pair
    for v in report["variants"]:
        g = row[v]["graphs"]
        steps = sum(p[v]["steps"] for p in row["points"])  # most steps of a rank at the point, over its trials
        assert g["graphed_steps"] > 0 and g["graphed_steps"] + g["eager_steps"] >= steps, (v, g)
        assert g["capture_s"] > 0 and g["pools"] == (1 if v == "replicated" else 2), (v, g)
    for v in report["variants"][1:]:
        assert row[v]["graphs"]["replay_graphed_steps"] > 0, row[v]["graphs"]
    assert "CUDA graphs (--graphs on): both variants replay" in format_table(report)


def test_gpu_bench_serve_two_ranks_that_cannot_capture_run_both_variants_eagerly_and_say_why():
    cluster, comm = _two_ranks()
    with cluster:
        with pytest.raises(RemoteError, match="--graphs on: the sharded variant's steps cannot be captured"):
            run_serve_bench(2, "small", WL, comm=comm, graphs="on", cluster=cluster, **SETUP)
        report = run_serve_bench(2, "small", WL, comm=comm, graphs="auto", cluster=cluster, **SETUP)
    text = format_table(report)
    print("\n" + text)
    why = report["graphs"]["eager_reason"]
    shared = report["ranks_per_device"] > 1
    assert why.startswith("both variants run every step eagerly: the sharded variant's steps cannot be captured")
    assert ("several ranks share one GPU" if shared else "needs our NCCL communicator") in why
    assert report["equal"] and report["differ"] == []
    row = report["rows_by_budget"][0]
    for v in report["variants"]:
        g = row[v]["graphs"]
        assert (g["graphed_steps"], g["shapes"], g["capture_s"], g["replay_graphed_steps"]) == (0, 0, 0.0, 0), (v, g)
        assert g["eager_steps"] > 0
    assert [line for line in text.splitlines() if "CUDA graphs" in line] == [f"  CUDA graphs: none (--graphs auto): {why}"]
