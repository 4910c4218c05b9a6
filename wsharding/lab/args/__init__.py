"""Every option of the ``wsharding`` command, in modules that import neither torch nor the library's torch code.

[Note: the command answers before torch loads] ``wsharding --help``, ``wsharding <command> --help`` and
every refusal of a value argparse checks (a type, a choice, an unknown option) are answered by the parsers
these modules build, and the module that runs a command -- with torch, a second or more to import -- is
imported only once its arguments are parsed. So a module here imports only the standard library and
modules without torch (:mod:`wsharding.lab.cliargs`, :mod:`wsharding.lab.outdir`, :mod:`wsharding.core.units`;
``tests/lab/test_cli_fast.py`` checks it in a fresh process); a list of names a choice needs (the presets)
is in :mod:`wsharding.lab.args.names`. The package's own ``__init__`` files that these imports run
(:mod:`wsharding`, :mod:`wsharding.serve`) import their names lazily for the same reason.

One module per command (``demo``, ``plan``, ``info``, ``soak``) and per benchmark (``bench_<name>``),
each with ``add_arguments(parser)``; the module that runs the command re-exports it.
"""
