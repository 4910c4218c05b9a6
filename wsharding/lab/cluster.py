"""N rank processes, started once, that run package functions on every rank.

A :class:`RankCluster` spawns one process per rank, each with a torch.distributed group: gloo on
127.0.0.1 when there is no GPU (CPU processes stand in for GPUs -- every report says so), one
process per GPU with NCCL when there are enough GPUs. ``cluster.run(fn, *args)`` runs
``fn(ctx, *args)`` on every rank and returns the results in rank order.

Why processes and not threads: each rank needs its own torch.distributed state, exactly as under
``torchrun``; scripts started by ``torchrun`` reach the same task functions through
:func:`init_from_env`.

Why spawn: fork breaks once CUDA is initialised, and a notebook's kernel may have touched CUDA.
Spawned workers import task functions by name, so task functions must live in an importable
module (the package, or a test module), never in a notebook cell.

Failure handling, the part that keeps notebooks and tests from hanging:

* a remote exception is re-raised here as :class:`RemoteError` with its rank and traceback;
* a worker that dies is noticed at once through its process sentinel (:class:`WorkerDied`);
* a task that does not finish within ``task_timeout`` raises :class:`TaskTimeout`;
* in the last two cases, and when ranks that did not fail are left stuck in a collective, all
  workers are killed and the cluster restarts on the next ``run``;
* leaving the ``with`` block, an error, KeyboardInterrupt or interpreter exit leave no process;
* a task that cannot be unpickled on a rank comes back as a :class:`RemoteError` of that task;
* the workers die with the process that started them, even when it is SIGKILLed (then no Python
  code of the parent runs: the kernel sends each worker SIGKILL, see [Note: parent-death signal]).

[Note: parent-death signal] Each worker asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to
be killed when its parent goes away. SIGKILL, not SIGTERM: a worker stuck in a collective or a GPU
wait sits in C code where a Python signal handler never runs. The kernel ties the signal to the
parent *thread*, so it is armed only when the cluster is started from the main thread (a cluster
started from another thread still stops its workers through the pipe's EOF when the parent exits
normally). A parent that died before the worker armed it is caught by comparing ``getppid()``.

[Note: start-up objects frozen] Tasks call ``gc.collect()`` where memory must be back before it is
measured or sized (before a load peak is metered, between serving runs before the next KV pool). A
full collection walks every object the collector tracks, and a rank holds ~170,000 of them before
its first task -- torch's and the package's modules, the process group -- alive until it exits: each
collection cost 60 ms of CPU for nothing, 9 per serving benchmark on each rank. Once its start-up
is done a worker moves them to the collector's permanent generation (``gc.freeze()``), which no
collection walks; what tasks create is collected as before.

[Note: the rendezvous port] The parent hosts the ``TCPStore`` the ranks meet at, bound to port 0:
the kernel picks a free port and the store holds it from that moment on. (Asking for a free port,
closing it and letting rank 0 bind it later leaves a window in which another process can take it.)

Several ranks on one GPU: NCCL's process group refuses two ranks on one device ("Duplicate GPU
detected"), so when ranks outnumber GPUs the ranks' control group is gloo by itself; the weight
gathers then go through our NCCL communicator (``comm.nccl``), and the torch.distributed NCCL
baseline cannot run (:data:`SHARED_GPU_TORCH_NOTE`).
"""

from __future__ import annotations

import ast
import atexit
import ctypes
import gc
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from wsharding.core.context import ClusterError, current_context, make_context, seconds_arg, set_current_context
from wsharding.core.emulation import CPU_EMULATION_NOTE, SHARED_GPU_NOTE
from wsharding.core.errors import WshardingError, require_int
from wsharding.core.units import ceil_div
from wsharding.fatal import add_last_words
from wsharding.io_checks import read_regular_file


class RemoteError(ClusterError):
    """A task raised on one or more ranks. ``rank`` is the first failing rank."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str, others: str = "",
                 errors: dict[int, tuple[str, str]] | None = None) -> None:
        self.rank = rank
        #: Every failing rank's ``(type, message)``, this one included.
        self.errors = dict(errors or {rank: (exc_type, message)})
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        text = f"rank {rank} raised {exc_type}: {message}\n--- remote traceback (rank {rank}) ---\n{remote_traceback}"
        if others:
            text += others
        super().__init__(text)


class WorkerDied(ClusterError):
    """A rank process exited while the cluster was waiting for it. ``rank``: the first that died;
    ``errors``: what the other ranks raised meanwhile (``rank -> (type, message)``, with a grace)."""

    def __init__(self, message: str, rank: int | None = None, errors: dict[int, tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.errors = dict(errors or {})


class TaskTimeout(ClusterError):
    """Ranks did not answer within the task timeout."""


# ------------------------------------------------------------------------------------------------
# The worker side
# ------------------------------------------------------------------------------------------------
class _TaskUnpicklable(WshardingError, RuntimeError):
    """A task (its function or an argument) could not be rebuilt on the rank."""


_SEND_LOCK = threading.Lock()  # the main thread's answers and a helper thread's last words share one pipe
_CURRENT_TASK: int | None = None  # the task a rank process is running, for its last words


def _send(conn: Connection, obj: Any) -> None:
    # Pickle here, not in a feeder thread: an unpicklable result must become an error message,
    # not a message that silently never arrives.
    try:
        data = pickle.dumps(obj)
    except Exception as e:  # noqa: BLE001 - any pickling failure becomes a remote error
        data = pickle.dumps(("error", obj[1], ("PicklingError", f"result could not be sent back: {e}", "")))
    with _SEND_LOCK:
        conn.send_bytes(data)


def _last_words_to_parent(conn: Connection) -> Callable[[str], None]:
    """[Note: a host held behind a stuck gather] (wsharding/fatal.py): when a helper thread ends
    this rank process, the running task's caller gets the reason as this rank's error."""

    def say(message: str) -> None:
        data = pickle.dumps(("ended", _CURRENT_TASK, ("CommError", f"{message} (the rank process was ended)", "")))
        if _SEND_LOCK.acquire(timeout=1.0):  # the main thread may be held mid-send: then say nothing
            try:
                conn.send_bytes(data)
            finally:
                _SEND_LOCK.release()

    return say


def _die_with_parent(parent_pid: int) -> None:
    """[Note: parent-death signal]: SIGKILL this process when its parent goes away (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # not Linux: the pipe's EOF is the only signal
        return
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _worker_main(
    rank: int,
    world: int,
    store_port: int,
    parent_pid: int | None,
    backend: str,
    device_index: int | None,
    shared_gpu: bool,
    timeout_s: float,
    threads: int,
    env: dict[str, str],
    conn: Connection,
) -> None:
    global _CURRENT_TASK
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    os.environ.update(env)
    torch.set_num_threads(threads)
    import torch.distributed as dist

    try:
        device = torch.device("cpu") if device_index is None else torch.device("cuda", device_index)
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
            if backend == "nccl":
                kwargs["device_id"] = device
        timeout = timedelta(seconds=timeout_s)
        # [Note: the rendezvous port]: the parent hosts the store; ranks are its clients.
        store = dist.TCPStore("127.0.0.1", store_port, None, False, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
        # [Note: shard groups and nodes]: every rank of a RankCluster runs on this host.
        ctx = make_context(rank, world, device, backend, shared_gpu, timeout, nodes=(0,) * world)
        set_current_context(ctx)
        add_last_words(_last_words_to_parent(conn))
        _send(conn, ("ready", None, ctx.mode))
    except BaseException as e:  # noqa: BLE001
        _send(conn, ("error", None, (type(e).__name__, str(e), traceback.format_exc())))
        return
    # [Note: start-up objects frozen]: what is alive now lives as long as the process
    gc.freeze()
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the parent went away: exit rather than linger
        envelope = pickle.loads(msg)  # (task id, pickled task): always loads, it holds only an int and bytes
        if envelope is None:
            break
        task_id, payload = envelope
        _CURRENT_TASK = task_id
        try:
            try:
                fn, args, kwargs = pickle.loads(payload)
            except Exception as e:  # noqa: BLE001 - the task's id is known: answer with an error, do not die
                raise _TaskUnpicklable(f"the task could not be unpickled on rank {rank}: {type(e).__name__}: {e}") from e
            value = fn(current_context(), *args, **kwargs)
            _send(conn, ("ok", task_id, value))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            _send(conn, ("error", task_id, (type(e).__name__, str(e), traceback.format_exc())))
    # Leave without destroy_process_group(): with gloo it waits for peers that may already be
    # gone, and the process's exit releases sockets and memory anyway.
    conn.close()
    _release_named_semaphores()
    os._exit(0)


def _release_named_semaphores() -> None:
    """[Note: named semaphores at a worker's exit]
    A rank is a spawned process, and there a multiprocessing lock is a named POSIX semaphore that the
    parent's resource tracker is told about; the lock's finalizer unlinks it and tells the tracker
    when the process exits through Python's exit handlers. ``os._exit`` skips those handlers, so
    every such lock a task made was reported when the tracker shut down: tqdm makes one per
    process for its bars (Hugging Face's "Loading weights", the checkpoint's bar), and
    ``examples/hf_llama.py`` on 2 ranks ended with "resource_tracker: There appear to be 2 leaked
    semaphore objects". Running multiprocessing's own finalizers here (priority >= 0, the ones its
    exit handler runs first) unlinks them without running the rest of the exit handlers that
    ``os._exit`` is there to skip."""
    from multiprocessing import util

    try:
        util._run_finalizers(0)  # the call multiprocessing's exit handler makes (Python >= 3.4)
    except Exception:  # noqa: BLE001 - a finalizer that fails must not keep the rank from exiting
        pass


# ------------------------------------------------------------------------------------------------
# The caller side
# ------------------------------------------------------------------------------------------------
#: RankCluster starts every rank as a process of this host, and gloo connects each to every other:
#: past this many the ranks' sockets outgrow the usual open-file limit (1024) -- a job that size is a
#: torchrun job over several nodes (init_from_env), not a RankCluster.
MAX_LOCAL_RANKS = 1024
_RANKS_TODO = (f"ask for 1 rank or more, at most {MAX_LOCAL_RANKS} processes on this host (larger jobs: torchrun "
               "--nproc-per-node N on each node, with init_from_env())")


def choose_backend(world_size: int, backend: str = "auto", ranks_per_gpu: int = 1) -> tuple[str, list[int | None]]:
    """Pick the backend and each rank's device index.

    ``auto``: NCCL with one GPU per rank when CUDA has at least ``world_size / ranks_per_gpu``
    GPUs, else gloo on CPU. ``ranks_per_gpu > 1`` shares GPUs between ranks (needs NCCL >= 2.30
    with ``NCCL_MULTI_RANK_GPU_ENABLE=1``): then the ranks' control group is gloo by itself, since
    NCCL's process group refuses two ranks on one device, and the devices are still GPUs.
    """
    world_size = require_int(world_size, "world_size", minimum=1, maximum=MAX_LOCAL_RANKS, error=ClusterError,
                             todo=_RANKS_TODO)
    ranks_per_gpu = require_int(ranks_per_gpu, "ranks_per_gpu", minimum=1, maximum=world_size, error=ClusterError,
                                todo=f"pass 1 (a GPU per rank) up to the {world_size} ranks (all on one GPU)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus and gpus * ranks_per_gpu >= world_size else "gloo"
    if backend == "gloo":
        return backend, [None] * world_size
    if backend != "nccl":
        raise ClusterError(f"unknown backend {backend!r}: use 'auto', 'gloo' or 'nccl'")
    if gpus * ranks_per_gpu < world_size:
        raise ClusterError(
            f"backend 'nccl' with {world_size} ranks needs {ceil_div(world_size, ranks_per_gpu)} GPUs at "
            f"{ranks_per_gpu} rank(s) per GPU; this machine has {gpus}. Use backend='gloo' or fewer ranks."
        )
    devices: list[int | None] = [r // ranks_per_gpu for r in range(world_size)]
    if len(set(devices)) < world_size:
        return "gloo", devices  # several ranks on one GPU: gloo controls them (module docstring)
    return backend, devices


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either side, possibly inside ``and``/``or``)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            sides = [node.left, *node.comparators]
            if any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
                    isinstance(x, ast.Constant) and x.value == "__main__" for x in sides):
                return True
    return False


#: The largest ``__main__`` script parsed to find its ``if __name__ == "__main__":`` block.
MAX_SCRIPT_BYTES = 16 << 20


def _unguarded_main_line() -> tuple[str, int] | None:
    """``(file, line)`` when the ``__main__`` script's top-level code is running a statement outside an
    ``if __name__ == "__main__":`` block -- a statement spawn's children run again when they re-import the
    script (multiprocessing's rule: a main module run by path, or by a module name not ending in
    ``__main__``); ``None`` otherwise, or when it cannot tell (a notebook, ``python -c``, a thread)."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if main is None or (spec_name is None and path is None):
        return None
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return None
    if spec_name is None and os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return None
    filename, line = frame.f_code.co_filename, frame.f_lineno
    try:
        # A script run from a pipe (python <(...), python /dev/stdin) is a FIFO: reading it again would
        # wait for a writer ([Note: only regular files] in wsharding.io_checks), so only a regular file
        # of a script's size is read; anything else cannot tell.
        text = read_regular_file(filename, "__main__ script", max_bytes=MAX_SCRIPT_BYTES, todo="")
        tree = ast.parse(text.decode("utf-8"), filename)
    except (WshardingError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.body and _is_main_guard(node.test):
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or node.body[-1].lineno):
                return None
    return filename, line


_LIVE: weakref.WeakSet[RankCluster] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for c in list(_LIVE):
        c.close()


class RankCluster:
    """``world_size`` rank processes that run package functions on every rank.

    >>> from wsharding.lab.cluster import RankCluster
    >>> from wsharding.lab.tasks.layout import describe_rank      # doctest: +SKIP
    >>> with RankCluster(2) as cluster:                       # doctest: +SKIP
    ...     cluster.run(describe_rank)

    Task functions take the :class:`RankContext` first: ``fn(ctx, *args, **kwargs)``.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "auto",
        ranks_per_gpu: int = 1,
        task_timeout: float = 120.0,
        collective_timeout: float = 60.0,
        start_timeout: float = 180.0,
        threads_per_rank: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:
        world_size = require_int(world_size, "world_size", minimum=1, maximum=MAX_LOCAL_RANKS, where="RankCluster",
                                 error=ClusterError, todo=_RANKS_TODO)
        cores = os.cpu_count() or 1
        threads_per_rank = require_int(threads_per_rank, "threads_per_rank", minimum=1, maximum=cores,
                                       where="RankCluster", error=ClusterError,
                                       todo=f"pass an integer >= 1, at most this machine's {cores} cores (more "
                                            "only make a rank's threads take turns)")
        task_timeout = seconds_arg("task_timeout", task_timeout)
        collective_timeout = seconds_arg("collective_timeout", collective_timeout)
        start_timeout = seconds_arg("start_timeout", start_timeout)
        if env is not None and not isinstance(env, Mapping):
            raise ClusterError(f"env must be a dict of environment variables (str -> str), got {type(env).__name__}")
        for key, value in (env or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ClusterError(
                    f"env[{key!r}] = {value!r} ({type(key).__name__} -> {type(value).__name__}): environment "
                    f"variables are strings; pass env={{{key!r}: {str(value)!r}}}"
                )
        self.world_size = world_size
        self.backend, self.device_indices = choose_backend(world_size, backend, ranks_per_gpu)
        used = [d for d in self.device_indices if d is not None]
        #: Ranks on GPUs (possibly sharing them); False for CPU processes.
        self.on_gpus = bool(used)
        self.shared_gpu = len(set(used)) < len(used)
        self.task_timeout = task_timeout
        self.collective_timeout = collective_timeout
        self.start_timeout = start_timeout
        self.threads_per_rank = threads_per_rank
        self.env = dict(env or {})
        if self.shared_gpu:
            self.env.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        self.mode = ""
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._store: Any = None  # the rendezvous TCPStore, hosted here
        self._next_task = 0
        #: Number of times the workers were (re)started; a notebook can show it.
        self.starts = 0

    # ---- life cycle -------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        """Process ids of the rank processes, in rank order (empty when stopped)."""
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def rendezvous_port(self) -> int | None:
        """The port of the store the ranks met at (held by this process while the cluster runs)."""
        return None if self._store is None else self._store.port

    @property
    def emulation(self) -> str:
        if not self.on_gpus:
            return CPU_EMULATION_NOTE
        return SHARED_GPU_NOTE if self.shared_gpu else ""

    def start(self) -> RankCluster:
        """Start the workers (no-op when they are running) and wait until every rank has joined."""
        if self.running:
            return self
        self.close()
        unguarded = _unguarded_main_line()
        if unguarded is not None:
            raise ClusterError(
                f"{unguarded[0]}:{unguarded[1]} starts rank processes outside an `if __name__ == \"__main__\":` block: "
                "each spawned rank process re-imports the script and would run this line again, starting ranks of "
                "its own. Move the code that starts the cluster under `if __name__ == \"__main__\":` "
                "(task functions stay at the top level of an importable module)"
            )
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        # [Note: the rendezvous port]
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=self.start_timeout),
                                    wait_for_workers=False)
        # [Note: parent-death signal]: armed only when this is the main thread.
        parent_pid = os.getpid() if threading.current_thread() is threading.main_thread() else None
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_worker_main,
                args=(
                    rank, self.world_size, self._store.port, parent_pid, self.backend, self.device_indices[rank],
                    self.shared_gpu, self.collective_timeout, self.threads_per_rank, self.env, child,
                ),
                name=f"wsharding-rank{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        _LIVE.add(self)
        self.starts += 1
        replies = self._collect(None, self.start_timeout, "start-up")
        self.mode = replies[0]
        return self

    def close(self) -> None:
        """Stop every worker; kill those that do not exit within a few seconds."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._store = None
        _LIVE.discard(self)

    def __enter__(self) -> RankCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten cluster must not leave processes behind
        try:
            self._kill()
        except Exception:  # noqa: BLE001
            pass

    # ---- tasks ------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the results in rank order."""
        return self.run_with(fn, args, kwargs)

    def run_with(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        per_rank_args: Sequence[Sequence[Any]] | None = None,
        timeout: float | None = None,
        grace: float | None = None,
    ) -> list[Any]:
        """Like :meth:`run`, with an explicit timeout and optional different arguments per rank
        (``per_rank_args[r]`` is appended to ``args`` on rank ``r``).

        ``grace``: once a rank raised or died, how long the other ranks get to answer, so that their
        own errors (a collective that timed out, a peer that closed) are reported too. Default: 3 s
        after an error; after a death none -- the others are stopped at once."""
        if getattr(fn, "__module__", None) in ("__main__", "__mp_main__") or "<lambda>" in getattr(fn, "__qualname__", ""):
            raise ClusterError(
                f"task {getattr(fn, '__qualname__', fn)!r} is defined in __main__ (a notebook or script) "
                "or is a lambda: spawned rank processes import tasks by name, so define it in an "
                "importable module such as the wsharding package"
            )
        if per_rank_args is not None and len(per_rank_args) != self.world_size:
            raise ClusterError(f"per_rank_args has {len(per_rank_args)} entries for {self.world_size} ranks")
        self.start()
        self._next_task += 1
        task_id = self._next_task
        for rank, conn in enumerate(self._conns):
            rank_args = tuple(args) + (tuple(per_rank_args[rank]) if per_rank_args is not None else ())
            try:
                # Two layers: the envelope always unpickles on the rank, so a task that cannot be
                # rebuilt there is answered as an error of this task id instead of killing the rank.
                payload = pickle.dumps((task_id, pickle.dumps((fn, rank_args, kwargs or {}))))
            except Exception as e:  # noqa: BLE001
                raise ClusterError(f"arguments of {fn.__qualname__} cannot be sent to the ranks: {e}") from e
            conn.send_bytes(payload)
        return self._collect(task_id, self.task_timeout if timeout is None else timeout, fn.__qualname__, grace)

    def _last_message(self, rank: int, task_id: int | None) -> tuple[str, Any] | None:
        """A message of this task still in the pipe of a rank whose process has ended, if any."""
        conn = self._conns[rank]
        try:
            while conn.poll(0):
                kind, tid, value = pickle.loads(conn.recv_bytes())
                if task_id is None or tid == task_id:
                    return kind, value
        except (EOFError, OSError):
            pass
        return None

    def _collect(self, task_id: int | None, timeout: float, what: str, grace: float | None = None) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        dead: dict[int, str] = {}
        ended: set[int] = set()  # ranks whose process ended itself after its error (wsharding.fatal)
        deadline = time.monotonic() + timeout
        grace_end: float | None = None  # set when the first rank fails
        by_conn = {c: r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        try:
            while len(results) + len(errors) + len(dead) < self.world_size:
                done = results.keys() | errors.keys() | dead.keys()
                pending_conns = [c for c, r in by_conn.items() if r not in done]
                if (errors or dead) and grace_end is None:
                    grace_end = time.monotonic() + (3.0 if grace is None else grace)
                remaining = deadline - time.monotonic()
                if grace_end is not None:  # once one rank failed, the others get the grace period
                    remaining = min(remaining, grace_end - time.monotonic())
                if remaining <= 0:
                    break
                ready = wait(pending_conns + list(by_sentinel), timeout=remaining)
                if not ready:
                    break
                for obj in ready:
                    if obj in by_conn:
                        rank = by_conn[obj]
                        try:
                            kind, tid, value = pickle.loads(obj.recv_bytes())
                        except (EOFError, OSError):
                            continue  # the sentinel will report the death
                        if task_id is not None and tid != task_id:
                            continue  # a late answer to an earlier, abandoned task
                        (results if kind in ("ok", "ready") else errors)[rank] = value
                        if kind == "ended":
                            ended.add(rank)
                    else:
                        rank = by_sentinel[obj]
                        last = self._last_message(rank, task_id)
                        if last is not None:  # its last words, sent just before it ended (wsharding.fatal)
                            kind, value = last
                            (results if kind in ("ok", "ready") else errors)[rank] = value
                            ended.add(rank)
                        if rank in results or rank in errors:
                            del by_sentinel[obj]
                            continue
                        proc = self._procs[rank]
                        proc.join(1.0)  # the sentinel fires before exitcode is filled in
                        code = proc.exitcode
                        how = f"exit code {code}"
                        if code is not None and code < 0:
                            how += f", killed by {signal.Signals(-code).name}"
                        dead[rank] = how
                        del by_sentinel[obj]
                        if grace is None:
                            break  # no grace after a death: stop the others now
                if dead and grace is None:
                    break
        except KeyboardInterrupt:
            self._kill()
            raise
        if dead:
            rank = min(dead)
            self._kill()
            text = (f"rank {rank} died ({dead[rank]}) during {what}; all ranks were stopped "
                    "and the cluster will restart on the next run")
            text += "".join(f"\n(rank {r} also died: {dead[r]})" for r in sorted(dead) if r != rank)
            text += "".join(f"\n(rank {r} raised {errors[r][0]}: {errors[r][1]})" for r in sorted(errors))
            raise WorkerDied(text, rank, {r: (e[0], e[1]) for r, e in errors.items()})
        if errors:
            rank = min(errors)
            exc_type, message, tb = errors[rank]
            others = "".join(
                f"\n(rank {r} also raised {errors[r][0]}: {errors[r][1]})" for r in sorted(errors) if r != rank
            )
            missing = [r for r in range(self.world_size) if r not in results and r not in errors]
            if missing:
                # Ranks stuck in a collective that the failing rank never joined: restart.
                others += f"\n(ranks {missing} did not finish; all ranks were stopped and will restart)"
            if ended:
                others += f"\n(the process of ranks {sorted(ended)} ended itself; all ranks were stopped and will restart)"
            if missing or ended:
                self._kill()
            raise RemoteError(rank, exc_type, message, tb, others, {r: (e[0], e[1]) for r, e in errors.items()})
        if len(results) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in results]
            self._kill()
            raise TaskTimeout(
                f"ranks {missing} did not answer {what} within {timeout:.1f} s; all ranks were stopped "
                "and the cluster will restart on the next run"
            )
        return [results[r] for r in range(self.world_size)]

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RankCluster(world_size={self.world_size}, backend={self.backend!r}, mode={self.mode!r}, {state})"
