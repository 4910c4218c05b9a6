"""The notes the library attaches to an emulated run: CPU processes standing in for GPUs, or several
ranks time-slicing one GPU. Timings from either are not those of N GPUs, so every report and message
that shows one says so -- in the words written here, once, so that the same emulation reads the same
wherever it appears.

Only the modules that tell which case a run is (the rank contexts, the NCCL communicator, the KV-cache
budget) import these; the short forms for figure titles and labels are the teaching layer's
(``wsharding.lab.emulation``). Nothing here imports the package.
"""

from __future__ import annotations

#: Words every CPU-rank report carries, so nobody mistakes CPU timings for GPU timings.
CPU_EMULATION_NOTE = "emulated: CPU processes (gloo over 127.0.0.1) stand in for GPUs; timings are not GPU timings"
#: Words every report of ranks that share one GPU carries (the rank context's and our NCCL communicator's).
SHARED_GPU_NOTE = "emulated: several ranks time-slice one GPU (NCCL multi-rank-per-GPU)"
#: Said once when ranks outnumber GPUs and a torch.distributed NCCL gather was asked for.
SHARED_GPU_TORCH_NOTE = (
    "the torch.distributed NCCL baseline cannot run with several ranks per GPU (NCCL's process group "
    "refuses two ranks on one device): the ranks use a gloo control group and gather with our NCCL communicator"
)
#: Where a CPU rank's KV-cache budget comes from: there is no free GPU memory to measure.
CPU_BUDGET_NOTE = "emulated: the machine's available RAM, shared by the CPU ranks, stands in for free GPU memory"
