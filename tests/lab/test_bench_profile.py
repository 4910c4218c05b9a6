"""``wsharding bench profile`` on 2 CPU (gloo) ranks: a real profile of the tiny sharded decoder, its
lanes (threads: there are no streams on CPU), their intervals inside the step and their classes; the
trace parser on a real CPU run's trace; the figure from the report."""

from __future__ import annotations

import json

import pytest
import torch

from wsharding.lab.bench.profile import (
    CLASSES,
    STEP_LABEL,
    cpu_class,
    format_table,
    labelled,
    lanes_from_trace,
    profile_rank,
    summarize,
)
from wsharding.models import ToyDecoder, decoder_config


@pytest.fixture(scope="module")
def report(cluster_of):
    results = cluster_of(2).run(profile_rank, "tiny", tokens=8, steps=2, comm="torch")
    return summarize(results, "tiny", 8, 2)


def test_every_rank_has_thread_lanes_with_intervals_inside_the_step(report):
    assert report["kind"] == "threads" and report["emulation"]
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:
        lanes = {lane["lane"]: lane for lane in r["lanes"]}
        assert "thread: model" in lanes and "host: layers" in lanes and "host: planner calls" in lanes
        assert r["step_us"] > 0
        for lane in r["lanes"]:
            assert lane["intervals"], lane["lane"]
            for start, end, cls, name in lane["intervals"]:
                assert 0 <= start <= end <= r["step_us"] + 1e-6
                assert cls in CLASSES
                assert 0 <= name < len(r["names"])
        # one host interval per layer of the model, in order
        layers = [r["names"][row[3]] for row in lanes["host: layers"]["intervals"]]
        assert layers == [f"layer {i}" for i in range(decoder_config("tiny").layers)]
        model_classes = {row[2] for row in lanes["thread: model"]["intervals"]}
        assert {"compute", "gather"} <= model_classes  # the layers compute; the sharded ones issue gathers


def test_report_is_small_and_says_its_emulation(report):
    assert len(json.dumps(report)) < 300_000
    text = format_table(report)
    assert "lanes are threads, not streams" in text and report["emulation"] in text


def test_parser_on_a_real_cpu_trace(tmp_path):
    """One process, no sharding: the parser still finds the last labelled step and the model's lanes."""
    cfg = decoder_config("tiny")
    model = ToyDecoder(cfg, seed=0).eval()
    x = torch.arange(6) % cfg.vocab
    with torch.no_grad(), labelled(model), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for s in range(2):
            with torch.profiler.record_function(f"{STEP_LABEL} {s}"):
                model(x)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    lanes = lanes_from_trace(trace)
    steps = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith(STEP_LABEL) and e.get("ph") == "X"]
    last = max(steps, key=lambda e: e["ts"])
    assert lanes["kind"] == "threads"
    assert lanes["step_us"] == pytest.approx(last["dur"], abs=0.01)
    by_name = {lane["lane"]: lane for lane in lanes["lanes"]}
    assert len(by_name["host: layers"]["intervals"]) == cfg.layers
    ops = by_name["thread: model"]["intervals"]
    assert ops and all(r[2] == cpu_class(lanes["names"][r[3]]) for r in ops)
    starts = [r[0] for r in ops]
    assert starts == sorted(starts) and all(a[1] <= b[0] + 0.02 for a, b in zip(ops, ops[1:], strict=False))  # outermost: no overlap


def test_parser_refuses_a_trace_without_a_step():
    with pytest.raises(ValueError, match=STEP_LABEL):
        lanes_from_trace({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 0, "dur": 1, "cat": "cpu_op"}]})


def test_device_intervals_are_classed_by_stream():
    """A trace in the form the CUDA activity writes: the stream with the GEMMs is the compute stream;
    NCCL kernels and memcpys on another stream are gathers."""
    ev = lambda name, cat, ts, dur, stream: {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur,  # noqa: E731
                                             "tid": stream, "pid": 0, "args": {"stream": stream}}
    trace = {"traceEvents": [
        {"ph": "X", "name": f"{STEP_LABEL} 0", "cat": "user_annotation", "ts": 100, "dur": 50, "tid": 1, "pid": 9},
        ev("sm90_gemm_bf16", "kernel", 110, 10, 7), ev("Memcpy DtoD", "gpu_memcpy", 105, 8, 13),
        ev("ncclDevKernel_AllGather", "kernel", 120, 5, 13), ev("Memcpy HtoD", "gpu_memcpy", 131, 2, 7),
        ev("rms_norm_kernel", "kernel", 135, 20, 7)]}
    lanes = lanes_from_trace(trace)
    assert lanes["kind"] == "streams"
    by = {lane["lane"]: lane for lane in lanes["lanes"]}
    assert set(by) == {"stream 7 (compute)", "stream 13 (gather)"}
    assert [r[2] for r in by["stream 7 (compute)"]["intervals"]] == ["compute", "copy", "compute"]
    assert [r[2] for r in by["stream 13 (gather)"]["intervals"]] == ["gather", "gather"]
    assert by["stream 7 (compute)"]["intervals"][-1][1] == 50  # clipped to the step's end


def test_figure_has_a_lane_per_rank_and_thread(report):
    pytest.importorskip("plotly")
    from wsharding.lab.viz.profile import THREADS_NOTE, stream_timeline_figure

    fig = stream_timeline_figure(report)
    lanes = {y for trace in fig.data for y in trace.y}
    assert lanes == {f"rank {r['rank']} · {lane['lane']}" for r in report["ranks"] for lane in r["lanes"]}
    assert THREADS_NOTE in fig.layout.title.text and report["date"] in fig.layout.title.text


def test_newest_saved_profile_is_picked_by_date(tmp_path):
    from wsharding.lab.bench.profile import newest_saved

    assert newest_saved(tmp_path) is None
    for folder, date in (("a-old", "2026-01-01"), ("b-new", "2026-02-01")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "profile_x.json").write_text(json.dumps({"bench": "profile", "date": date}))
    (tmp_path / "profile_other.json").write_text(json.dumps({"bench": "step", "date": "2027-01-01"}))
    assert newest_saved(tmp_path)["date"] == "2026-02-01"
