"""Where a command writes what it was not told where to write: never into the checkout's tracked folders.

[Note: the default output folder]
Every command that writes files by default (the demo's figures, the benchmarks' reports, the
checkpoint ``bench load`` reads) writes them under one folder, :func:`default_out_dir`:

* run from inside the wsharding checkout (its top or any folder under it, ``notebooks/``
  included): ``wsharding-out/`` at the top of the checkout, which ``.gitignore`` lists, so
  ``git status`` stays clean wherever in the checkout the command ran;
* run anywhere else (a pip-installed package, another project): ``./wsharding-out/`` in the
  current folder, where a user looks for what a command wrote.

Never a user cache folder: a figure there is a figure nobody finds. ``figures/`` holds the committed
figures and is written only when asked (``wsharding demo --figures figures``). Every command prints
each path it writes.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The folder's name, at the top of the checkout (listed in .gitignore) or in the current folder.
OUT_NAME = "wsharding-out"
#: Said in ``--help`` beside every default path (argparse's ``%`` formatting: no bare percent signs).
OUT_RULE = (f"{OUT_NAME}/ is at the top of the wsharding checkout when run inside it (git-ignored), "
            "else in the current folder")


def checkout_root() -> Path | None:
    """The git checkout this package is imported from, or None for an installed package.

    The package's parent folder counts as a checkout when it holds ``.git`` (a folder, or a file
    in a git worktree) and the ``pyproject.toml`` of this project."""
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists() and (root / "pyproject.toml").is_file():
        return root
    return None


def default_out_dir(cwd: str | os.PathLike[str] | None = None) -> Path:
    """The folder of every default output ([Note: the default output folder]), for a command run in
    ``cwd`` (default: the current folder). The folder is not created here."""
    here = Path(cwd if cwd is not None else Path.cwd()).resolve()
    root = checkout_root()
    if root is not None and (here == root or root in here.parents):
        return root / OUT_NAME
    return here / OUT_NAME


def default_output(name: str, cwd: str | os.PathLike[str] | None = None) -> str:
    """``name`` (a file name, prefix or sub-path) under :func:`default_out_dir`, spelled relative to the
    current folder when it lies below it (``wsharding-out/bench_step``), else absolute -- the spelling
    ``--help`` shows and the command prints."""
    here = Path(cwd if cwd is not None else Path.cwd()).resolve()
    path = default_out_dir(here) / name
    try:
        return str(path.relative_to(here))
    except ValueError:
        return str(path)


def default_help(path: str) -> str:
    """The ``--help`` words for a default output ``path`` (from :func:`default_output`), escaped for
    argparse's ``%`` formatting."""
    return f"default {path}; {OUT_RULE}".replace("%", "%%")
