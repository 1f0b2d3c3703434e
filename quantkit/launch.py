"""`quantize --nproc N`: start N local ranks of a data-parallel run and watch them.

Each rank is a fresh process (start method "spawn") with the environment torchrun would give it
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT on localhost), so a rank runs exactly the code a
torchrun worker runs. The parent only watches: the first rank to fail (an error, a crash, a kill)
ends the run; the others are stopped and the run fails with one line naming that rank and why.
A rank that hangs is caught by the others' collective timeout, which makes them fail in turn.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import threading
import warnings
from typing import Any, Callable

from quantkit.errors import QuantkitError, first_line

STOP_GRACE_S = 10.0  # a stopped rank gets this long to exit on SIGTERM before it is killed


class RankFailed(QuantkitError):
    """A data-parallel run ended because one of its ranks failed (not an input problem: exit code 1)."""

    exit_code = 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local_ranks(nproc: int, target: Callable[..., Any], kwargs: dict) -> Any:
    """target(**kwargs) on `nproc` local ranks; returns rank 0's result, or raises RankFailed."""
    try:
        pickle.dumps((target, kwargs))
    except Exception as exc:
        raise QuantkitError(f"--nproc hands the arguments to new processes, and one cannot be pickled "
                            f"({first_line(exc)}); pass names or files instead of in-memory objects") from None
    ctx = multiprocessing.get_context("spawn")
    # one pipe per rank for its one message (a Queue's semaphores would leak when a rank is killed)
    pipes = [ctx.Pipe(duplex=False) for _ in range(nproc)]
    port, quiet = free_port(), _library_quietness()
    ranks = [ctx.Process(target=_rank_main, args=(rank, nproc, port, target, kwargs, pipes[rank][1], quiet),
                         name=f"quantkit-rank{rank}") for rank in range(nproc)]
    for p in ranks:
        p.start()
    for _, send in pipes:
        send.close()  # the ranks hold their ends
    messages: dict[int, tuple[str, Any]] = {}
    try:
        failed, alive = _watch(ranks, [receive for receive, _ in pipes], messages)
    except BaseException:
        _stop(ranks)
        raise
    if failed:
        cause = _first_cause(failed, messages)
        kind, text = messages.get(cause, ("", ""))
        if kind == "error":  # a problem a rank found with the input (every rank finds it): said as one process says it
            raise QuantkitError(text)
        raise RankFailed(_failure_line(cause, ranks[cause].exitcode, messages, alive))
    if 0 not in messages:
        raise RankFailed("data-parallel run stopped: rank 0 ended without a result")
    return messages[0][1]


def _watch(ranks: list, pipes: list, messages: dict) -> tuple[list[int], list[int]]:
    """Wait for every rank (reading each one's message as it comes, into `messages`); once one exits
    non-zero, stop the rest. Returns the ranks that failed on their own (several may have, in the
    same instant: a killed rank's peers lose contact at once) and those still running then (a rank
    the others timed out waiting for is among them)."""
    running = {p.sentinel: r for r, p in enumerate(ranks)}
    waiting = {conn: r for r, conn in enumerate(pipes)}
    while running:
        ready = multiprocessing.connection.wait(list(running) + list(waiting))
        for conn in [c for c in ready if c in waiting]:
            _receive(waiting.pop(conn), conn, messages)
        done = [running.pop(s) for s in ready if s in running]
        for rank in done:
            ranks[rank].join()
        failed = [r for r in done if ranks[r].exitcode != 0]
        if failed:
            failed += [r for r in running.values() if not ranks[r].is_alive() and ranks[r].exitcode]
            alive = sorted(r for r in running.values() if r not in failed)
            _stop(ranks)
            for conn, r in waiting.items():  # a message sent just before the end
                _receive(r, conn, messages)
            return sorted(set(failed)), alive
    for conn, r in waiting.items():
        _receive(r, conn, messages)
    return [], []


def _receive(rank: int, conn, messages: dict) -> None:
    try:
        if conn.poll():
            messages[rank] = conn.recv()
    except (EOFError, OSError):
        pass


def _first_cause(failed: list[int], messages: dict) -> int:
    """The failed rank to blame: one with its own error or killed from outside, before one that only
    lost contact with the others."""
    return next((r for r in failed if not _lost_contact(messages.get(r))), failed[0])


def _lost_contact(message) -> bool:
    return message is not None and message[0] == "lost"


def _stop(ranks: list) -> None:
    for p in ranks:
        if p.is_alive():
            p.terminate()
            if hasattr(signal, "SIGCONT"):  # a stopped (hung) rank handles SIGTERM only once continued
                os.kill(p.pid, signal.SIGCONT)
    for p in ranks:
        p.join(STOP_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()


def _failure_line(rank: int, exitcode: int, messages: dict, alive: list[int]) -> str:
    kind, reason = messages.get(rank, ("", ""))
    if kind == "lost" and alive:  # it waited in vain for ranks that were still running: they hang
        reason = f"got no answer from rank {', '.join(map(str, alive))} within the timeout ({reason})"
    elif not reason:
        reason = (f"was killed ({signal.Signals(-exitcode).name})" if exitcode < 0 else f"exited with code {exitcode}")
    return (f"data-parallel run stopped: rank {rank} {reason}; the finished layers are kept: rerun the same command "
            "with --resume (any --nproc) to continue")


def _library_quietness() -> dict:
    """The parent's transformers/datasets logging and progress-bar settings, for its ranks to copy
    (a fresh process starts from the libraries' defaults)."""
    import datasets
    import transformers

    return {"transformers": (transformers.utils.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()),
            "datasets": (datasets.utils.logging.get_verbosity(), datasets.is_progress_bar_enabled())}


def _copy_quietness(quiet: dict) -> None:
    import datasets
    import transformers

    level, bars = quiet["transformers"]
    transformers.utils.logging.set_verbosity(level)
    if not bars:
        transformers.utils.logging.disable_progress_bar()
    level, bars = quiet["datasets"]
    datasets.utils.logging.set_verbosity(level)
    if not bars:
        datasets.disable_progress_bars()


def _share_cores(world: int) -> None:
    """Give each local rank its share of this machine's cores for torch's intra-op threads (what
    torchrun's OMP_NUM_THREADS does, but a share, not 1): every rank would otherwise start one thread
    per core, and N ranks' threads spinning on the same cores cost more than the work (measured in
    scripts/bench_distributed.py). A user's OMP_NUM_THREADS wins."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // world))


def _rank_main(rank: int, world: int, port: int, target: Callable[..., Any], kwargs: dict, results, quiet: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _copy_quietness(quiet)
    _share_cores(world)
    from tqdm.std import tqdm

    # tqdm's default lock is a multiprocessing semaphore: a killed rank would leave it registered
    # with the parent's resource tracker, which then warns about it at exit
    tqdm.set_lock(threading.RLock())
    if rank:
        warnings.simplefilter("ignore")  # rank 0 speaks for the run
    from quantkit.pipeline.distributed import exit_process

    try:
        value = target(**kwargs)
    except QuantkitError as exc:
        results.send(("error", str(exc)))
        exit_process(2)
    except BaseException as exc:  # noqa: BLE001 - one line for the parent, whatever happened
        results.send(describe_crash(exc))
        exit_process(1)
    results.send(("ok", value))


def describe_crash(exc: BaseException) -> tuple[str, str]:
    """(kind, one line) for an unexpected exception in a rank: a collective that timed out or a peer
    that vanished said plainly ("lost"), anything else as what it is ("crash")."""
    text = first_line(exc)
    if "timed out" in text.lower():
        return "lost", "a collective timed out"
    lost = ("Connection closed", "Connection reset", "Broken pipe", "NCCL communicator was aborted", "ProcessGroup")
    if any(marker in text for marker in lost):
        return "lost", f"lost contact with the other ranks ({text[:200]})"
    if isinstance(exc, KeyboardInterrupt):
        return "crash", "was interrupted"
    return "crash", f"crashed: {type(exc).__name__}: {text[:300]}"
