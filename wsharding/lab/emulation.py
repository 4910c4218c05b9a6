"""The short words of emulation, for figure titles and one-line labels.

The notes themselves -- what a CPU rank, a shared GPU or a CPU KV budget says about its run -- are
the library's (:mod:`wsharding.core.emulation`): the rank contexts, our NCCL communicator and the
KV-cache budget attach them to what they report. Here are the shorter forms the teaching layer's
figures and summaries show for them.
"""

from __future__ import annotations

from wsharding.core.emulation import CPU_EMULATION_NOTE, SHARED_GPU_NOTE

#: A CPU-rank run, short enough for a figure title or a one-line label.
CPU_EMULATION_SHORT = "emulated: CPU ranks"
#: A run of several ranks that time-slice one GPU, as short.
SHARED_GPU_SHORT = "emulated: several ranks time-slice one GPU"

_SHORT = {CPU_EMULATION_NOTE: CPU_EMULATION_SHORT, SHARED_GPU_NOTE: SHARED_GPU_SHORT}


def title_note(emulation: str) -> str:
    """What a figure title or a one-line label appends for a run's ``emulation`` note:
    ``" (emulated: CPU ranks)"``, ``" (emulated: several ranks time-slice one GPU)"``, ``""`` on
    real GPUs; any other note in full."""
    return f" ({_SHORT.get(emulation, emulation)})" if emulation else ""
