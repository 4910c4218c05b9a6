"""Our NCCL backend: a ctypes binding of libnccl (``binding``), library discovery and version gate
(``library``), symmetric buffers and windows (``symmetric``), the shard group (``group``), the
communicator (``communicator``, with its constructor's steps in ``startup``, its refusals in
``policy``, its failures in ``failures`` and ``watchdog``, its close and abort in ``teardown``, its
graphs in ``graphs``, its gathers in ``gather`` and ``gather_now``, and the opt-in issue thread in
``issuing``) and the copy-engine checks (``probe``). Importing this package loads no library and
needs no GPU."""

from wsharding.accel.nccl.binding import FUNCTIONS, NcclBinding, NcclConfig, NcclError, NcclUniqueId, make_config
from wsharding.accel.nccl.communicator import (
    CTA_POLICY_ZERO,
    CommTimeout,
    NcclCommunicator,
    NcclGatherHandle,
    check_cta_policy_env,
    from_context,
)
from wsharding.accel.nccl.library import (
    ENV_VAR,
    MIN_MULTI_RANK_GPU,
    MIN_SYMMETRIC,
    NcclLibrary,
    NcclLibraryError,
    default_library,
    find_library,
    load_library,
)

__all__ = [
    "CTA_POLICY_ZERO", "ENV_VAR", "FUNCTIONS", "MIN_MULTI_RANK_GPU", "MIN_SYMMETRIC", "CommTimeout", "NcclBinding",
    "NcclCommunicator", "NcclConfig", "NcclError", "NcclGatherHandle", "NcclLibrary", "NcclLibraryError",
    "NcclUniqueId", "check_cta_policy_env", "default_library", "find_library", "from_context", "load_library",
    "make_config",
]
