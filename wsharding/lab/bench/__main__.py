"""``python -m wsharding.lab.bench allgather ...``: the benchmarks without the rest of the CLI (the GPU
machine lacks plotly and ipywidgets, which other subcommands may import)."""

import sys

from wsharding.lab.bench import add_arguments, main
from wsharding.lab.cliargs import OneLineParser, run_command

parser = OneLineParser(prog="python -m wsharding.lab.bench")
add_arguments(parser)
args = parser.parse_args()
sys.exit(run_command(f"bench {args.bench}", main, args))
