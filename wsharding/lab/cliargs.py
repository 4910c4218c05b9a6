"""Argument checks shared by the subcommands: bad input is answered in one line, before any work.

Every subcommand follows what ``wsharding plan`` does: a value that cannot work (``--ranks 0``, a
size that is not a number, a JSON path under a file) is refused while parsing or right after, with
one line naming the option, the value and what to pass instead -- never after minutes of work,
never as a traceback, never by silently running the default instead.

Errors raised on the ranks come back from :class:`~wsharding.lab.cluster.RankCluster` as one
:class:`~wsharding.lab.cluster.RemoteError`; :func:`error_lines` turns it into one line per distinct
error (``--verbose`` adds the remote tracebacks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wsharding.core.errors import WshardingError

#: CPU rank processes are full Python processes with torch (a few hundred MB each); past this many
#: the machine swaps or the gloo rendezvous times out -- and the code path is the same from 2 ranks.
MAX_CPU_RANKS = 16
#: Several ranks may share one GPU (NCCL >= 2.30); a shard group is at most one node of 8 GPUs.
MAX_RANKS_PER_GPU = 8


class InputError(WshardingError, ValueError):
    """Bad command-line input, found before any work started."""


#: reStructuredText that docstrings use and a terminal shows literally: ``code``, :role:`~a.b.name`.
_RST_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj|ref):`~?([^`]*)`")
_RST_LITERAL = re.compile(r"``([^`]*)``")


def plain_text(text: str) -> str:
    """``text`` without the reStructuredText a terminal would show literally: ````wsharding```` becomes
    wsharding, ``:func:`~wsharding.core.layout.plan``` becomes plan (the last dotted part after ``~``,
    else the whole name). Descriptions come from docstrings, which are written for Sphinx and for
    ``help()``; ``--help`` is read in a terminal."""
    def role(m: re.Match[str]) -> str:
        return m.group(1).rsplit(".", 1)[-1] if "`~" in m.group(0) else m.group(1)

    return _RST_LITERAL.sub(r"\1", _RST_ROLE.sub(role, text))


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse's default adds the whole usage) and whose
    ``--help`` is plain text (:func:`plain_text`: descriptions taken from docstrings lose their markup).
    Subcommands' parsers are of the same class (argparse makes them with the parent's class)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {self.reworded(message)} (see {self.prog} --help)\n")

    def reworded(self, message: str) -> str:
        """argparse's own messages in the words our types use. Its required-argument check runs before
        its unknown-option check, so ``wsharding --frobnicate`` would say only that a COMMAND is
        missing: the unknown option is named first. A bare ``type=int`` says "invalid int value"
        where :func:`checked_number` says "is not a whole number": one wording for one mistake."""
        unknown = [a for a in getattr(self, "_argv", []) if a.startswith("-") and a != "-"
                   and not self._negative_number_matcher.match(a)
                   and a.split("=", 1)[0] not in self._option_string_actions]
        if message.startswith("the following arguments are required") and unknown:
            return f"unrecognized arguments: {' '.join(unknown)}"
        m = re.fullmatch(r"(argument [^:]+: )invalid (int|float) value: ('.*')", message)
        if m:
            return f"{m.group(1)}{m.group(3)} is not a {'whole number' if m.group(2) == 'int' else 'number'}"
        return message

    def format_help(self) -> str:
        return plain_text(super().format_help())

    def format_usage(self) -> str:
        return plain_text(super().format_usage())


def add_verbose_option(p: argparse.ArgumentParser) -> None:
    """``--verbose``: errors from the ranks come with their remote tracebacks."""
    p.add_argument("--verbose", action="store_true",
                   help="on an error, also print the tracebacks (remote ones from the ranks included)")


# ---- argparse types: the message names the value and says what is expected ------------------------
def int_at_least(low: int, why: str = "") -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= ``low`` (``why``: said with the bound when refused)."""
    return checked_number(int, low, why=why)


def checked_number(kind: type, low: float, high: float | None = None, *, why: str = "") -> Callable[[str], float]:
    """An argparse ``type`` for one number of ``kind`` (int or float) in ``[low, high]``. A float must
    be finite: ``nan`` passes every comparison and ``inf`` every lower bound, and either ends in a
    traceback (or a run that never ends) long after parsing. ``why`` is said with the bound when a
    value outside it is refused."""
    what = "whole number" if kind is int else "number"
    because = f" ({why})" if why else ""

    def parse(text: str) -> float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
        if kind is float and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low:g}{because}, got {text}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:g}{because}, got {text}")
        return v

    parse.__name__ = f"{'integer' if kind is int else 'number'} >= {low:g}"
    return parse


def number_list(kind: type, low: float, unit: str, example: str,
                below: float | None = None) -> Callable[[str], list]:
    """An argparse ``type`` for a comma-separated list of ``kind`` values, each > ``low``
    (``kind`` int: >= ``low``) and, given ``below``, each < ``below`` (a fraction: checked here, before
    any rank starts)."""

    def parse(text: str) -> list:
        out = []
        for part in text.replace(";", ",").split(","):
            part = part.strip()
            if not part:
                continue
            try:
                v = kind(part)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{part!r} is not a {'whole ' if kind is int else ''}number of {unit} (example: {example})"
                ) from None
            if kind is float and not math.isfinite(v):
                raise argparse.ArgumentTypeError(f"{part!r} is not a finite number of {unit} (example: {example})")
            if v < low or (kind is float and v <= low):
                bound = f"at least {low}" if kind is int else f"more than {low:g}"
                raise argparse.ArgumentTypeError(f"{part!r}: every value must be {bound} {unit}")
            if below is not None and v >= below:
                raise argparse.ArgumentTypeError(f"{part!r}: every value must be less than {below:g}")
            out.append(v)
        if not out:
            raise argparse.ArgumentTypeError(f"give at least one value in {unit} (example: {example})")
        return out

    parse.__name__ = f"comma-separated {unit}"
    return parse


def checked_text(parse: Callable[[str], Any]) -> Callable[[str], str]:
    """An argparse ``type`` that refuses what ``parse`` refuses and keeps the text as it was (for a
    command that parses the text itself)."""

    def check(text: str) -> str:
        parse(text)
        return text

    check.__name__ = parse.__name__
    return check


# ---- the JSON result: one option name for every command ------------------------------------------
def add_json_option(p: argparse.ArgumentParser, what: str, *aliases: str) -> None:
    """``--json [PATH]``: write ``what`` as JSON to PATH, or print it (no PATH, or ``-``).

    ``aliases`` are older spellings, accepted but not shown in ``--help``.
    """
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH", type=json_path,
                   help=f"write {what} as JSON to PATH; with no PATH (or -), print the JSON instead of the table")
    for alias in aliases:
        p.add_argument(alias, dest="json", type=json_path, help=argparse.SUPPRESS)


def json_path(text: str) -> str:
    """The argparse ``type`` of ``--json``: an empty path would pass every check and fail only when
    the result is written, after the whole run."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path: give a file path, or --json alone (or -) to print the JSON "
                                         "instead")
    return text


def nonempty_path(text: str) -> str:
    """An argparse ``type`` for a path where an empty one would be read as "not given"."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path: give a file path")
    return text


def check_output_path(path: str | os.PathLike, option: str, *, directory: bool = False) -> None:
    """Refuse, before any work, an output path that cannot be written: a parent that is a file, a
    folder where nothing may be created, a file where a folder is wanted or the other way round.

    Checked by doing it: the missing folders and the file (for a folder, a scratch file inside it)
    are created and what this check made is removed again; an existing file is opened for appending,
    which leaves it as it was. Permission bits cannot tell: root passes ``os.access`` everywhere, yet
    cannot create a file under ``/proc`` or ``/sys`` or on a read-only mount."""
    if str(path) in ("", "-"):
        return
    p = Path(path).expanduser().absolute()
    if p.exists() and p.is_dir() != directory:
        want = "a folder" if directory else "a file"
        raise InputError(f"{option} {path}: this path exists and is not {want}")
    parent = p if directory else p.parent
    top = parent
    while not top.exists():
        top = top.parent
    if not top.is_dir():
        raise InputError(f"{option} {path}: {top} is a file, so nothing can be written below it; "
                         "choose another path")
    missing = [parent, *parent.parents][: len(parent.parts) - len(top.parts)]
    made: list[Path] = []  # folders this check created, removed again in reverse order
    doing = "create"
    try:
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
        if directory:
            fd, scratch = tempfile.mkstemp(dir=parent, prefix=".wsharding-write-check-")
            os.close(fd)
            os.unlink(scratch)
        elif p.exists():
            doing = "open for writing"
            # O_NONBLOCK: a FIFO without a reader is refused at once instead of blocking the check
            os.close(os.open(p, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        else:
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            p.unlink()
    except OSError as e:
        where = e.filename or (parent if directory else p)
        raise InputError(f"{option} {path}: cannot {doing} {where} ({e.strerror}); choose another path") from None
    finally:
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                pass


def emit_json(obj: Any, path: str | None) -> str | None:
    """Print ``obj`` as JSON (``path`` ``-``) or write it to ``path`` (folders created). Returns
    the path written, or None."""
    if path is None:
        return None
    text = json.dumps(obj, indent=1)
    if path == "-":
        print(text)
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return str(out)


# ---- errors from the ranks -----------------------------------------------------------------------
_ALSO = re.compile(r"^\(rank (\d+) also raised ([\w.]+): (.*)\)$")
_MISSING = re.compile(r"^\(ranks (\[[\d, ]*\]) did not finish")


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def error_lines(exc: BaseException, verbose: bool = False) -> list[str]:
    """One line per distinct error, naming the ranks that raised it (a RemoteError carries every
    failing rank); other exceptions give their one-line message. ``verbose`` appends the remote
    traceback of the first failing rank."""
    from wsharding.lab.cluster import RemoteError

    if not isinstance(exc, RemoteError):
        return [f"{type(exc).__name__}: {_one_line(str(exc))}"]
    seen: dict[tuple[str, str], list[int]] = {(exc.exc_type, _one_line(exc.remote_message)): [exc.rank]}
    tail = []
    text = str(exc)
    for line in text.splitlines():
        m = _ALSO.match(line.strip())
        if m:
            seen.setdefault((m.group(2), _one_line(m.group(3))), []).append(int(m.group(1)))
        elif _MISSING.match(line.strip()):
            tail.append(line.strip().strip("()"))
    out = []
    for (etype, msg), ranks in seen.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))
        out.append(f"{who}: {etype}: {msg}")
    out += tail
    if verbose:
        out.append(f"--- remote traceback (rank {exc.rank}) ---")
        out += exc.remote_traceback.rstrip().splitlines()
    else:
        out.append("(--verbose shows the remote traceback)")
    return out


def run_command(command: str, main: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run a subcommand's ``main``; every error of the package (a :class:`WshardingError`: its
    message names the culprit and says what to do) becomes :func:`fail`'s lines, anything else keeps
    its traceback (that is a bug to report). The one place for every subcommand: a library check
    that refuses a value after parsing (``bench serve --rate 0`` reaches ``Workload``'s) answers like
    argparse does, not with a traceback."""
    verbose = bool(getattr(args, "verbose", False))
    try:
        return int(main(args) or 0)
    except WshardingError as e:  # the communicator's, NCCL's, the cost model's and the ranks' errors derive from it
        if verbose:
            import traceback

            traceback.print_exc()
        return fail(command, e, verbose)


def is_bad_input(exc: BaseException) -> bool:
    """Whether ``exc`` refused what was asked (exit status 2, as argparse's), rather than failed while
    working (1). The package's own error classes say which by the built-in they derive from: a
    ``ValueError``/``TypeError``/``KeyError`` kind (``InvalidArgument``, ``CostModelError``, ...) is a
    value that cannot work; a ``RuntimeError`` or ``AssertionError`` kind (the ranks', the
    communicator's, NCCL's, a benchmark whose results differ) is a failure -- and anything raised on
    the ranks comes back as a ``RemoteError``, a failure, whatever it was there."""
    if isinstance(exc, InputError):
        return True
    from wsharding.lab.cluster import RemoteError  # imported here: it imports torch, which bad input must not wait for

    return (isinstance(exc, WshardingError) and not isinstance(exc, (RemoteError, RuntimeError, AssertionError))
            and isinstance(exc, (ValueError, TypeError, KeyError)))


def fail(command: str, exc: BaseException, verbose: bool = False) -> int:
    """Print ``exc`` as ``wsharding COMMAND: error: ...`` lines on stderr; return exit status 2 for
    bad input (:func:`is_bad_input`: one line, the message alone, as argparse's), 1 for a failure
    while working (its class named, one line per distinct error of the ranks)."""
    bad = is_bad_input(exc)
    lines = [_one_line(str(exc))] if bad else error_lines(exc, verbose)
    print(f"wsharding {command}: error: {lines[0]}", file=sys.stderr)
    for line in lines[1:]:
        print(f"  {line}", file=sys.stderr)
    return 2 if bad else 1


def length_range(text: str) -> tuple[int, int]:
    """The argparse ``type`` of a ``LOW:HIGH`` token-length range (``N``: ``N:N``), 1 <= LOW <= HIGH."""
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give LOW:HIGH tokens, e.g. 16:64") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LOW <= HIGH")
    return a, b


def slo_arg(text: str) -> Any:
    """The argparse ``type`` of ``--slo`` (:meth:`~wsharding.serve.metrics.SLO.parse`), its refusal one line."""
    from wsharding.serve.metrics import SLO

    try:
        return SLO.parse(text)
    except WshardingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
