"""``python -m wsharding.lab.bench allgather ...``: the benchmarks without the rest of the CLI (the GPU
machine lacks plotly and ipywidgets, which other subcommands may import)."""

import argparse
import sys

from wsharding.lab.bench import add_arguments, main

parser = argparse.ArgumentParser(prog="python -m wsharding.lab.bench")
add_arguments(parser)
sys.exit(main(parser.parse_args()))
