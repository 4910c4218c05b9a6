"""``python -m wsharding ...``: the ``wsharding`` command without an installed entry point."""

import sys

from wsharding.lab.cli import main

sys.exit(main())
