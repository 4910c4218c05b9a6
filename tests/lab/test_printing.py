"""Printed lines fit the output area: wrapped at spaces, never inside a word or a number."""

from wsharding.lab.printing import say, wrap


def test_long_lines_wrap_at_spaces_with_an_indent_and_short_ones_stay():
    line = "  net saving " + " ".join(f"{n:,} B" for n in range(1_000_000, 1_000_030))
    out = wrap(line, 60).split("\n")
    assert len(out) > 1 and all(len(x) <= 60 for x in out)
    assert all(x.startswith("    ") for x in out[1:])  # its own indent plus two
    assert " ".join(x.strip() for x in out) == line.strip()  # no word cut, nothing lost
    table = "a    b\n" + "x" * 30
    assert wrap(table, 60) == table


def test_say_prints_like_print(capsys):
    say("rank", 0, "of", 2)
    say("a", "b", sep="-")
    assert capsys.readouterr().out == "rank 0 of 2\na-b\n"
