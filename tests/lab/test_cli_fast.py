"""[Note: the command answers before torch loads] (:mod:`wsharding.lab.args`): ``--help`` and argument
errors are answered without importing torch, and ``import wsharding`` alone imports nothing heavy.

Checked in one fresh interpreter: each command line below is parsed and answered in turn, and after each
one ``sys.modules`` must still lack torch (the first that imports it is named). No time is measured.
"""

from __future__ import annotations

import json
import subprocess
import sys

#: (command line, exit status): --help of the command and of every subcommand, and one refused value of
#: each (a type, a choice, an unknown option, a bound, and a check made from the arguments alone).
CASES = [
    ("--help", 0),
    ("--frobnicate", 2),
    ("demo --help", 0), ("demo --ranks 0", 2), ("demo --preset nope", 2),
    ("plan --help", 0), ("plan --ranks two", 2), ("plan --kv-share 0.1", 2),
    ("plan --serve --preset kimi-k3-b200-fp8 --profile measure", 2),
    ("info --help", 0), ("info --frobnicate", 2),
    ("soak --help", 0), ("soak --steps 3", 2),
    ("bench --help", 0), ("bench nope", 2),
    ("bench allgather --help", 0), ("bench allgather --policies 1", 2), ("bench allgather --sizes 0.000001", 2),
    ("bench step --help", 0), ("bench step --model nope", 2),
    ("bench schedule --help", 0), ("bench schedule --depths 0", 2),
    ("bench load --help", 0), ("bench load --tokens 0", 2),
    ("bench draft --help", 0), ("bench draft --commit-ms 5000", 2),
    ("bench profile --help", 0), ("bench profile --preset nope", 2),
    ("bench serve --help", 0), ("bench serve --kv-share 2", 2), ("bench serve --slo ttft=x", 2),
    ("bench serve --rate x", 2), ("bench serve --graphs sometimes", 2),
]

PROBE = r"""
import contextlib, io, json, sys
results = []
import wsharding
results.append(["import wsharding", None, "torch" in sys.modules])
from wsharding.lab.cli import main
for line, _ in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(line.split())
        except SystemExit as e:
            rc = e.code
    results.append([line, rc, "torch" in sys.modules, err.getvalue()])
    if "torch" in sys.modules:
        break
print(json.dumps(results))
"""


def test_help_and_argument_errors_do_not_import_torch():
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CASES)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert results[0] == ["import wsharding", None, False], "import wsharding imported torch"
    torch_after = [r[0] for r in results[1:] if r[2]]
    assert not torch_after, f"wsharding {torch_after[0]} imported torch"
    assert [(r[0], r[1]) for r in results[1:]] == CASES
    for line, rc, _, err in results[1:]:
        if rc == 2:  # refused in one line of the command's
            assert len(err.strip().splitlines()) == 1 and err.startswith("wsharding") and ": error: " in err, (line, err)


def test_the_package_face_still_offers_every_name():
    import wsharding
    from wsharding.core.runner import shard_blocks

    assert wsharding.shard_blocks is shard_blocks
    assert wsharding.core.__doc__.startswith("The essential path")  # a subpackage read as an attribute is imported
    assert set(wsharding.__all__) <= set(dir(wsharding))
    for name in wsharding.__all__:
        assert getattr(wsharding, name) is not None
    try:
        wsharding.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("an unknown name was not refused")


def test_the_light_names_equal_the_tables_they_stand_for():
    from wsharding.core.layout import ALIGNMENT
    from wsharding.lab.args import names
    from wsharding.lab.args.bench_allgather import MIN_SIZE_BYTES
    from wsharding.models import PRESETS
    from wsharding.models.blocks import BLOCK_PRESETS

    assert names.DECODER_PRESETS == tuple(sorted(PRESETS))
    assert names.BLOCK_PRESETS == tuple(sorted(BLOCK_PRESETS))
    assert MIN_SIZE_BYTES == ALIGNMENT
