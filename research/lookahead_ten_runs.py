"""Ten runs in a row of the planner panel's own function (``planner_view``, notebook 03) on a
RankCluster of 2 gloo ranks, lookahead off then on, the panel's defaults: prints each rank's median
exposed wait and whether lookahead on showed less on every rank, every time.

Run from the repository root: ``.venv/bin/python research/lookahead_ten_runs.py``."""

from wsharding.lab.cluster import RankCluster
from wsharding.lab.widgets.planner import planner_view

if __name__ == "__main__":
    with RankCluster(2, backend="gloo") as cluster:
        wins = 0
        for i in range(10):
            off = planner_view(cluster, "tiny", lookahead=False).exposed_ms
            on = planner_view(cluster, "tiny", lookahead=True).exposed_ms
            ok = all(on[k] < off[k] for k in off)
            wins += ok
            print(f"run {i}: off " + ", ".join(f"rank {k} {v:.2f} ms" for k, v in sorted(off.items()))
                  + " | on " + ", ".join(f"rank {k} {v:.2f} ms" for k, v in sorted(on.items()))
                  + f" | on < off: {ok}", flush=True)
        print(f"{wins}/10 runs with less exposed wait on every rank with lookahead on")
