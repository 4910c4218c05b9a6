"""``wsharding bench load`` on CPU ranks: the peaks it prints are the package's exact byte counts -- a
model built with its weights held R + the rest, one built on meta held R/N + the rest -- and the command
prints them side by side."""

from __future__ import annotations

import argparse

from wsharding.lab.bench.load import format_table, load_peak_rank, main


def test_the_meta_build_holds_its_rows_and_the_rest_and_the_whole_build_held_r(cluster_of, tmp_path):
    results = cluster_of(2).run(load_peak_rank, "tiny-blocks", str(tmp_path / "blocks.safetensors"), 8)
    for r in results:
        whole, meta = r["whole"], r["meta"]
        R, rest = whole["replicated"], whole["rest"]
        assert whole["load_peak"] == R + rest and whole["built_whole"] == R  # every weight existed whole
        assert meta["load_peak"] == R // 2 + rest and meta["built_whole"] == 0  # only its rows, and the rest
        assert meta["resident"] == meta["formula"]
    text = format_table(results, "tiny-blocks", 8)
    assert "built with weights | built on meta" in text and "emulated" in text


def test_the_command_runs_and_writes_its_json(tmp_path, capsys):
    args = argparse.Namespace(ranks=2, model="tiny-blocks", comm="torch", tokens=4,
                              checkpoint=str(tmp_path / "{model}.safetensors"), json=str(tmp_path / "load"))
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "wsharding bench load -- tiny-blocks, 2 ranks" in out and (tmp_path / "load.json").exists()
