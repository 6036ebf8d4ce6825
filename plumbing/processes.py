"""A stage's process: its flags checked, a stop with one line, its rank among the others, its signals, its memory."""

import atexit
import contextlib
import ctypes
import functools
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import fields
from typing import Annotated, get_type_hints

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from rich.console import Console
from rich.table import Table
from rich.text import Text


def script() -> str:
    """The running script's file name (sft.py, ...): its messages' prefix and the owner of the folders it writes."""
    return os.path.basename(sys.argv[0])

def fail(message: str) -> None:
    """Stop with a one-line message that says what to fix, instead of a stack trace from inside a library."""
    raise SystemExit(f"{script()}: error: {message}")

@contextlib.contextmanager
def stop_on(*errors):
    """Inside it, an exception of one of ERRORS stops the run as fail does, with its message: the refusal of a function
    written to be copied alone (ppo.sample), which cannot call fail."""
    try:
        yield
    except errors as error:
        fail(str(error))

def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A table on the console whose title and cells show as the text they are: a prompt or a response that holds
    square brackets ("[INST] ... [/INST]") is never read as rich's markup."""
    table = Table(title=Text(title), show_lines=True)
    for column in columns:
        table.add_column(Text(column))
    for row in rows:
        table.add_row(*map(Text, row))
    Console().print(table)

def exact_div(a: int, b: int, what: str) -> int:
    """a / b, which must divide exactly: batch arithmetic is never silently rounded."""
    if b <= 0 or a % b != 0:
        fail(f"{what}: {a} is not divisible by {b}")
    return a // b

# Ranges that check_ranges enforces, read from each Args field's annotation: "--total-episodes must be at least 1".
PositiveInt = Annotated[int, "be at least 1"]
CountInt = Annotated[int, "not be negative"]
PositiveFloat = Annotated[float, "be positive"]
NonNegativeFloat = Annotated[float, "not be negative"]
Fraction = Annotated[float, "be between 0 and 1"]
Seed = Annotated[int, "be between 0 and 2**32 - 1"]
RANGES = {"be at least 1": lambda v: v >= 1, "be positive": lambda v: v > 0, "not be negative": lambda v: v >= 0,
          "be between 0 and 1": lambda v: 0 <= v <= 1, "be between 0 and 2**32 - 1": lambda v: 0 <= v < 2**32}

def check_ranges(args) -> None:
    """Every float flag finite and every flag within its annotation's range (PositiveInt, ...), or one line."""
    for field in fields(args):  # first: nan fails every range, and "must be a finite number" says why
        value = getattr(args, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{field.name.replace('_', '-')} must be a finite number, not {value}")
    for name, hint in get_type_hints(type(args), include_extras=True).items():
        value = getattr(args, name)
        for rule in getattr(hint, "__metadata__", ()):
            if value is not None and not RANGES[rule](value):
                fail(f"--{name.replace('_', '-')} must {rule}, not {value}")
    for name, stage in vars(args).items():
        if name.endswith("zero_stage") and stage == 0 and getattr(args, "offload", False):
            fail(f"--offload needs --{name.replace('_', '-')} 1, 2 or 3: DeepSpeed offloads only a partitioned "
                 "optimizer, and ZeRO-0 keeps it whole on the device")


def init_distributed(args, zero3: bool) -> torch.device:
    """Join the ranks (deepspeed or torchrun set RANK; plain `python` is one rank), set args.local_rank, world_size,
    return this rank's device; stop if the launcher dies, and with one line on Ctrl-C or SIGTERM. zero3: whether any
    of the script's models is partitioned by ZeRO-3, whose collectives copy tensors on gloo's threads."""
    launchers = watch_launcher()  # before the set-up: a rank waiting there for a peer must not outlive its launcher
    if "RANK" not in os.environ:  # one rank, on any free port
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    on_cpu = get_accelerator().device_name() == "cpu"
    if args.dtype == "fp16" and on_cpu:
        fail("--dtype fp16 needs a GPU: DeepSpeed has no fp16 on CPU; use --dtype bf16 or fp32")
    args.local_rank = int(os.environ["LOCAL_RANK"])
    get_accelerator().set_device(args.local_rank)
    if on_cpu:
        keep_freed_memory()
        if zero3:  # before gloo starts the threads that run the collectives
            one_openmp_thread_for_new_threads()
        # Plain gloo: DeepSpeed would compile its shared-memory all-reduce (for its inference kernels only) at a
        # machine's first run, a minute, and wait in silence forever on the lock a killed build leaves (detail 40).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())  # see end_run
    stop_on_signals()
    args.world_size = dist.get_world_size()
    if args.world_size > 1:
        sys.excepthook = functools.partial(one_line_for_a_lost_rank, launchers)
    return torch.device(get_accelerator().device_name(args.local_rank))

def peak_resident_gb() -> float:
    """This process's peak resident memory in GB: Linux's VmHWM (getrusage's ru_maxrss starts from the peak of the
    process that spawned it), elsewhere getrusage's figure."""
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)

def peak_memory_gb() -> dict:
    """This rank's peak memory so far, in GB: on a GPU torch's allocated and reserved figures; on a CPU the process's
    peak resident memory for both (DeepSpeed's CPU figures miss the peaks between its readings)."""
    if get_accelerator().device_name() == "cpu":
        peak = peak_resident_gb()
        return {"max_allocated_gb": peak, "max_reserved_gb": peak}
    return {"max_allocated_gb": get_accelerator().max_memory_allocated() / 2**30,
            "max_reserved_gb": get_accelerator().max_memory_reserved() / 2**30}

def free_port() -> str:
    """A TCP port free on this machine now, for a process group: two runs side by side must not take the same one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])

def keep_freed_memory() -> None:
    """On a CPU with glibc: memory a tensor of up to 32 MiB frees stays for the next one, not faulted in again page by
    page (a generation at the benchmark's shape: 1,000 faults, 7 with this): mallopt's M_MMAP_THRESHOLD (-3) at its
    largest, 32 MiB, and M_TRIM_THRESHOLD (-1) at twice that."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 32 * 2**20)
        libc.mallopt(-1, 64 * 2**20)

def one_openmp_thread_for_new_threads() -> None:
    """On a CPU: threads started from now on (gloo's, which run the collectives) do tensor work on one OpenMP thread,
    not a team each (ZeRO-3 on one 2-core rank: 99 s instead of 61 s). Only for ZeRO-3: below it gloo's threads start
    no team, and a one-rank run took 3% longer with it."""
    torch.get_num_threads()  # this thread takes its count now, before the default for new threads changes
    setter = threading.Thread(target=torch.set_num_threads, args=(1,))
    setter.start()
    setter.join()

def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return pid > 0

def end_run() -> None:
    """Last call of a finished run: ranks wait for one another; several then skip Python's shutdown, where a gloo
    thread freeing a tensor dies in a C++ destructor: "terminate called without an active exception" (gdb; 1 in 10)."""
    dist.barrier()
    if dist.get_world_size() > 1:  # one rank returns: the tests run stages in their own process
        atexit._run_exitfuncs()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)

def on_rank_0(function):
    """function() on rank 0 only, its result (or the message it stopped with) sent to every rank."""
    result = [None, None]
    try:
        result = [function(), None] if dist.get_rank() == 0 else result
    except SystemExit as stop:
        result = [None, str(stop)]
    dist.broadcast_object_list(result, src=0)
    if result[1] is not None:
        raise SystemExit(result[1])
    return result[0]

# What a collective says when a peer is gone: gloo's words, and NCCL's (its DistBackendError's "remote process exited",
# a socket's "Connection closed by remote peer", and then "communicator was aborted").
LOST_PEER = ["Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
             "remote process exited", "Connection closed by remote peer", "communicator was aborted"]

def one_line_for_a_lost_rank(launchers, kind, error, trace) -> None:
    """sys.excepthook of a run of several ranks: a collective that lost its peer ends this rank with one line, not
    gloo's or NCCL's stack trace; if the launcher is gone, watch_launcher's thread says so first."""
    if not (isinstance(error, RuntimeError) and any(words in str(error) for words in LOST_PEER)):
        return sys.__excepthook__(kind, error, trace)
    if launchers and not launchers_alive(launchers):
        time.sleep(10)  # watch_launcher's thread ends this rank first, with its line
    # The message's first line, without the source file it names: "[pair.cc:553] Connection closed by peer ...",
    # "NCCL error in: .../ProcessGroupNCCL.cpp:3763, remote process exited or there was a network error, ...".
    reason = re.sub(r"^(\[[^\]]*\] )+|^NCCL error in: \S+, ", "", str(error).strip().splitlines()[0]).split(". ")[0]
    print(f"{script()}: error: rank {dist.get_rank()} lost its connection to another rank of this run ({reason}): "
          "that rank stopped, or the launcher did; their output says why", file=sys.stderr, flush=True)

def stop_on_signals() -> None:
    """Ctrl-C or a scheduler's SIGTERM ends the run with one line, its lock released, instead of a traceback."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: fail(f"stopped by {signal.Signals(signum).name}"))

def parent_and_start(pid: int) -> tuple[int, str] | None:
    """A process's parent and start time (Linux /proc); None once it is gone, or dead and not yet reaped (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in "ZX" else (int(fields[1]), fields[19])
    except (OSError, IndexError):
        return None

def launchers_alive(launchers: list[tuple[int, str]]) -> bool:
    """Whether each (pid, start time) of watch_launcher's list still runs (the same process, not a reused pid)."""
    return all((parent_and_start(pid) or (None, None))[1] == start for pid, start in launchers)

def watch_launcher() -> list[tuple[int, str]]:
    """Exit within seconds when the launcher dies (a killed `deepspeed` or `torchrun` leaves its ranks training): a
    thread checks each second that every ancestor running this Python is there (Linux /proc). Returns them."""
    watched, pid = [], os.getppid()
    while pid > 1 and (process := parent_and_start(pid)) and \
            os.path.realpath(f"/proc/{pid}/exe") == os.path.realpath("/proc/self/exe"):
        watched.append((pid, process[1]))
        pid = process[0]
    def watch():
        while launchers_alive(watched):
            time.sleep(1)
        print(f"{script()}: error: rank {os.environ.get('RANK')}: the launcher that started this rank is gone; "
              "stopping", file=sys.stderr, flush=True)
        os._exit(1)
    if watched:
        threading.Thread(target=watch, daemon=True).start()
    return watched

def rank_share(rows: list, rank: int, world_size: int, filler) -> list:
    """This rank's share of ROWS for an evaluation on every rank: every world_size-th row from the rank-th, padded with
    filler(rows[0]) (counting for nothing) to the longest share, so that every rank runs as many forward passes
    (under ZeRO-3, collectives)."""
    share = rows[rank::world_size]
    return share + [filler(rows[0])] * (math.ceil(len(rows) / world_size) - len(share))

def sum_over_ranks(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each value (a scalar tensor) summed over all ranks, in one all_reduce, in float64."""
    summed = torch.stack([value.double() for value in values.values()])
    dist.all_reduce(summed)
    return dict(zip(values, summed.tolist()))
