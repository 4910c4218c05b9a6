"""Shared fixtures. Rank processes are started once per world size for the whole session, so the
suite does not pay process start-up per test; every cluster is closed at the end of the session."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from hypothesis import settings

from wsharding.lab.cluster import RankCluster

settings.register_profile("wsharding", deadline=None, max_examples=60)
settings.load_profile("wsharding")


@pytest.fixture(scope="session")
def cluster_of():
    """``cluster_of(n)`` -> a running CPU (gloo) RankCluster of ``n`` ranks, shared by the session."""
    clusters: dict[int, RankCluster] = {}

    def get(n: int) -> RankCluster:
        if n not in clusters:
            clusters[n] = RankCluster(n, backend="gloo", task_timeout=120, collective_timeout=30)
        return clusters[n].start()

    yield get
    for c in clusters.values():
        c.close()
    assert not [p for p in mp.active_children() if p.name.startswith("wsharding-rank")], "rank processes left behind"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine with -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
