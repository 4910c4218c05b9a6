"""``wsharding info [--json [PATH]]``: what this machine offers weight sharding.

torch and CUDA versions, the GPUs, the NCCL library our backend would load (path, where it was
found, version), what of symmetric windows, the copy-engine AllGather, several ranks on one GPU and
layer views mapped over the chunks (``map_own_chunk="auto"`` maps where this is yes) this machine can use (``supports``: one boolean per feature -- the library offers it *and* there
are CUDA GPUs; ``library_offers`` lists what the library version alone offers, and ``why`` says
what is missing), and which backend ``RankCluster(backend="auto")`` would choose.
"""

from __future__ import annotations

import argparse
import os
import platform
from typing import Any

import torch

from wsharding.comm_by_name import COMMS, resolve_comm
from wsharding.lab.args.info import add_arguments as add_arguments
from wsharding.lab.cliargs import check_output_path, emit_json
from wsharding.lab.emulation import CPU_EMULATION_SHORT

#: The features a libnccl version offers (keys of NcclLibrary.describe()).
FEATURES = ("symmetric_windows", "copy_engine_allgather", "multi_rank_per_gpu", "mapped_layer_views")


def _nccl_info() -> dict[str, Any]:
    from wsharding.accel.nccl.library import ENV_VAR, NcclLibraryError, NcclLibraryMissing, find_library, load_library

    try:
        choice = find_library()
        lib = load_library(choice.path, choice.source)
    except NcclLibraryError as e:
        return {"error": str(e), "env_var": ENV_VAR, "missing": isinstance(e, NcclLibraryMissing)}
    info = {k: v for k, v in lib.describe().items() if k not in FEATURES}
    info["features"] = {k: bool(lib.describe()[k]) for k in FEATURES}
    info["env_var"] = ENV_VAR
    info["env_value"] = os.environ.get(ENV_VAR)
    return info


def _torch_nccl() -> str | None:
    try:
        from torch.cuda import nccl

        v = nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - CPU builds of torch have no NCCL
        return None


def collect_info() -> dict[str, Any]:
    """Everything ``wsharding info`` prints, as a dict (what ``--json`` writes)."""
    from wsharding.lab.cluster import choose_backend

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "memory_GiB": round(p.total_memory / 2**30, 1),
                         "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    nccl = _nccl_info()
    n = len(gpus)
    auto_backend, _ = choose_backend(max(n, 1) if n else 4, "auto")
    # One boolean per feature, in one place: usable here = the library offers it and there are GPUs.
    # (A library flag "true" beside a machine flag "false" under the same name reads as a contradiction.)
    offered = nccl.pop("features", dict.fromkeys(FEATURES, False))
    supports = {k: bool(n) and v for k, v in offered.items()}
    if "error" in nccl:
        why = "no usable NCCL library (nccl.error says why)"
    elif not n:
        why = "no CUDA GPU on this machine (the library offers: " + (", ".join(k for k, v in offered.items() if v) or "none") + ")"
    else:
        missing = [k for k, v in offered.items() if not v]
        why = f"NCCL {nccl['version']} is too old for: {', '.join(missing)}" if missing else ""
    # the communicator "auto" picks, by the registry's one rule
    auto_comm = COMMS[resolve_comm("auto", on_gpus=bool(n))]
    gather = f"{auto_comm.name}: {auto_comm.what}"
    if not n:
        gather += f" ({CPU_EMULATION_SHORT})"
    elif why:
        gather += f" ({why})"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "torch_nccl": _torch_nccl(),
        "nccl": nccl,
        "supports": supports,
        "library_offers": [k for k, v in offered.items() if v],
        "why": why,
        "auto": {"cluster_backend": auto_backend, "gather_backend": gather},
        "env": {k: os.environ[k] for k in ("NCCL_CTA_POLICY", "NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_CUMEM_ENABLE")
                if k in os.environ},
    }


def format_info(info: dict[str, Any]) -> str:
    lines = [f"python {info['python']}, torch {info['torch']}, CUDA {info['cuda'] or '-'} "
             f"(available: {info['cuda_available']}), torch's NCCL {info['torch_nccl'] or '-'}"]
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(f"GPU {g['index']}: {g['name']}, {g['memory_GiB']} GiB, sm {g['capability']}, "
                         f"{g['multiprocessors']} SMs")
    else:
        lines.append("GPUs: none")
    n = info["nccl"]
    if "error" in n:
        lines.append(f"NCCL library: not usable -- {n['error']}")
    else:
        lines.append(f"NCCL library: {n['version']} at {n['path']} (found via {n['source']})")
    s = info["supports"]
    lines.append("supports: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in s.items())
                 + (f" -- {info['why']}" if info["why"] else ""))
    lines.append(f"auto: cluster backend {info['auto']['cluster_backend']}; gathers by {info['auto']['gather_backend']}")
    for k, v in info["env"].items():
        lines.append(f"env {k}={v}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    check_output_path(args.json or "", "--json")
    info = collect_info()
    if args.json != "-":
        print(format_info(info))
    written = emit_json(info, args.json)
    if written:
        print(f"wrote {written}")
    # No NCCL at all is an install without the optional ``nccl`` extra, which CPU ranks do not need: said,
    # not failed. A library that is there (or named) but cannot be used is a broken install: exit 1.
    return 1 if "error" in info["nccl"] and not info["nccl"]["missing"] else 0
