"""Where does a rank end up when its peer skips a gather? Two GPUs, rank 1 goes missing.

    torchrun --nproc-per-node 2 research/gpu_probes/missing.py model 1   # model steps, blocking comm
    torchrun --nproc-per-node 2 research/gpu_probes/missing.py gather 0  # one gather, non-blocking comm

``model``: rank 0 steps a sharded tiny decoder back to back (a serving loop) and should get the
watchdog's error within the 5 s timeout ([Note: backpressure] in wsharding/core/planner.py). ``gather``:
one in-place gather and a host wait on it, then close ([Note: abort with a stuck gather]). After 25 s
faulthandler prints every thread's stack and ends the process, so a hang shows where it sits.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist

from wsharding.accel.nccl.communicator import NcclCommunicator
from wsharding.core.comm import CommError


def main() -> None:
    scenario, blocking = sys.argv[1], sys.argv[2] == "1"
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo")
    dev = torch.device("cuda", rank)
    c = NcclCommunicator(None, device=dev, blocking=blocking, timeout_s=5.0)
    faulthandler.dump_traceback_later(25, exit=True)
    t0 = time.perf_counter()

    def say(*words: object) -> None:
        print(f"[r{rank} {time.perf_counter() - t0:6.2f}s blocking={blocking}]", *words, flush=True)

    try:
        if scenario == "gather":
            full = c.alloc(4 << 20, tag="full")
            c.register_all()
            n = full.numel() // 2
            if rank == 1:
                time.sleep(12)
                c.abort()
                c.close()
                say("left")
            else:
                h = c.all_gather_into(full, full[:n], async_op=True)
                say("issued")
                try:
                    h.synchronize()
                except CommError as e:
                    say("error:", str(e)[:160])
                c.close()
                say("closed; memory left to the exit:", c.leaked)
        else:
            from wsharding.models import build_pair, decoder_config

            _, net = build_pair(decoder_config("tiny"), c)
            x = torch.arange(3, device=dev)
            with torch.no_grad():
                net(x)
                torch.cuda.synchronize()
                c.barrier()
                if rank == 1:
                    time.sleep(12)
                else:
                    steps = 0
                    try:
                        while time.perf_counter() - t0 < 20:
                            net(x)
                            steps += 1
                    except CommError as e:
                        say(f"error after {steps} steps:", str(e)[:200])
    except CommError as e:
        say("raised", type(e).__name__, str(e)[:200])
    say("end")
    os._exit(0)  # a stream stuck in a gather must not hold the exit


if __name__ == "__main__":
    main()
