"""The test suite's rank launcher: runs SCRIPT on NPROC local ranks, as torchrun --standalone does,
but forks the ranks from a process that has already imported torch and megatron.

    python tests/_ranks.py NPROC SCRIPT [ARGS...]     one launch
    python tests/_ranks.py --serve SOCKET             one import, then a launch per request

Every rank is still its own process with its own gloo process groups and the environment torchrun
gives it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*), and runs the script as
__main__, exactly as `python SCRIPT ARGS` would in a torchrun rank. What the fork saves is the
import of torch and megatron: ~9 s of CPU per rank on a CI machine, most of the suite's time. One
more cost every launch would pay per rank is paid once too: transformers (megatron's tokenizer
builder imports it, even for the NullTokenizer).

Where there is no CUDA the CPU backend is activated before megatron is imported, as
pretrain_moe.py and every test worker do first (activate() is idempotent; it must precede
megatron's import).

Serving: the server never runs anything but the import, so every launch forks from the same
state. A request is one JSON line (nproc, script, args, env, cwd) with the file descriptor the
launch's output goes to; the server forks a launcher for it, answers its pid, and, once it has
exited, its exit status (tests/_launch.py decides which requests it may serve: those whose
environment differs from the server's only where nothing reads it at import).

A launcher hosts the rendezvous store itself (TORCHELASTIC_USE_AGENT_STORE, as torchrun's agent
does), created after the fork so that no rank inherits its thread. When a rank exits non-zero, the
others get GRACE_S to finish on their own (a refusal exits on every rank), then SIGTERM, then
SIGKILL; when a rank is killed, the others are stopped at once. The launcher prints
`[ranks] pids: P0 P1 ...` once the ranks run and, last, `[ranks] exit codes: C0 C1 ...`
(negative: killed by that signal); its exit status is the first failing rank's, or 0.

A rank ends as the interpreter would end it (the script's exception or SystemExit reported and
turned into the exit status, non-daemon threads joined, the atexit handlers run, stdout and
stderr flushed), but without the interpreter's finalization: tearing down the modules writes the
reference count of every object the rank inherited from the import, so the kernel copies the
forked heap page by page, ~1 s of each launch's 2 cores. Under torchrun (tests whose subject is
how the ranks stop) they finalize as users' ranks do.
"""

import atexit
import ctypes
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import time
import uuid

GRACE_S = 10.0
TERM_S = 10.0
CPU_AFFINITY = "RANKS_CPU_AFFINITY"  # the cores a launch's ranks run on, comma-separated
PRELOAD = ("torch._dynamo", "megatron.core.models.gpt",
           "megatron.core.models.hybrid.hybrid_model", "megatron.core.dist_checkpointing",
           "megatron.training.training", "megatron.core.tokenizers.text")


def _preload() -> None:
    import torch

    if not torch.cuda.is_available():
        from moe_launcher import cpu_backend

        cpu_backend.activate()
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:  # megatron-core 0.15.x has no megatron.training or HybridModel
            pass
    # What the import made lives as long as a rank does: out of the collector's sight (CPython's
    # advice for servers that fork), no rank's collections walk it or write to its pages, and a
    # rank's exit does not either. A 4-rank launch of the tiny model: 9.4 s -> 5.2 s from the
    # ranks' start to their exit, 3.9 s -> 1.4 s of that their exit (2 cores).
    gc.freeze()


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _fork() -> int:
    sys.stdout.flush()
    sys.stderr.flush()  # or the child would print again what the parent had buffered
    return os.fork()


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _rank_environment(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
            "ROLE_RANK": str(rank), "ROLE_NAME": "default", "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _fork_ranks(nproc: int) -> tuple[int | None, dict[int, int], list[int]]:
    """(this process's rank, or None in the launcher; pid -> rank; the port pipes' write ends)."""
    pids, writers = {}, []
    for rank in range(nproc):
        read_end, write_end = os.pipe()
        pid = _fork()
        if pid == 0:
            for fd in writers + [write_end]:
                os.close(fd)
            _die_with_parent()  # a launcher killed by a test's timeout takes its ranks along
            with os.fdopen(read_end) as pipe:
                port, run_id = pipe.read().split()
            os.environ.update(_rank_environment(rank, nproc, int(port), run_id))
            if cores := os.environ.get(CPU_AFFINITY):  # LiveRun(cores=...): the bench's one core
                os.sched_setaffinity(0, {int(core) for core in cores.split(",")})
            return rank, {}, []
        os.close(read_end)
        pids[pid] = rank
        writers.append(write_end)
    return None, pids, writers


def _supervise(pids: dict[int, int]) -> int:
    codes: dict[int, int] = {}
    first_failure, deadline, terminated = None, None, False
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pids:
            codes[pids[pid]] = _exit_code(status)
            if codes[pids[pid]] != 0 and first_failure is None:
                first_failure = codes[pids[pid]]
                # A killed rank leaves the others waiting in a collective: stop them at once.
                deadline = time.monotonic() + (GRACE_S if first_failure > 0 else 0)
            continue
        if deadline is not None and time.monotonic() > deadline:
            signum = signal.SIGKILL if terminated else signal.SIGTERM
            for running, rank in pids.items():
                if rank not in codes:
                    os.kill(running, signum)
            terminated, deadline = True, time.monotonic() + TERM_S
        time.sleep(0.05)
    print("[ranks] exit codes: " + " ".join(str(codes[r]) for r in sorted(codes)), flush=True)
    return 0 if first_failure is None else first_failure if first_failure > 0 else 1


def _launch(nproc: int) -> int | None:
    """Forks the ranks: None in a rank (which then runs the script), the exit status here."""
    rank, pids, writers = _fork_ranks(nproc)
    if rank is not None:
        return None
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    for write_end in writers:
        os.write(write_end, f"{store.port} tests-{uuid.uuid4().hex[:12]}".encode())
        os.close(write_end)
    print("[ranks] pids: " + " ".join(str(pid) for pid in pids), flush=True)
    forward = lambda signum, _frame: [os.kill(pid, signum) for pid in pids]  # noqa: E731
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return _supervise(pids)


def _serve(path: str) -> list[str]:
    """Answers requests until killed; returns only in a forked launcher, with its command line
    (NPROC SCRIPT ARGS...) and its environment, working directory and output in place."""
    _die_with_parent()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    print("[ranks] serving", flush=True)
    events = selectors.DefaultSelector()
    events.register(server, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # launcher pid -> the connection to answer
    while True:
        for key, _ in events.select(timeout=0.1):
            connection, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 1)
            request = json.loads(message)
            pid = _fork()
            if pid == 0:
                events.close()
                server.close()
                connection.close()
                os.setsid()  # the client stops a launch by killing its process group
                for target in (1, 2):
                    os.dup2(fds[0], target)
                os.close(fds[0])
                os.environ.clear()
                os.environ.update(request["env"])
                os.chdir(request["cwd"])
                return [str(request["nproc"]), request["script"], *request["args"]]
            os.close(fds[0])
            connection.sendall(f"{pid}\n".encode())
            waiting[pid] = connection
        for pid, connection in list(waiting.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                try:
                    connection.sendall(f"{_exit_code(status)}\n".encode())
                except OSError:  # the client went away (it killed the launch)
                    pass
                connection.close()
                del waiting[pid]


def main() -> int | None:
    """The launcher's exit status, or None in a rank, with sys.argv set for the script."""
    _preload()
    command = _serve(sys.argv[2]) if sys.argv[1] == "--serve" else sys.argv[1:]
    status = _launch(int(command[0]))
    if status is None:
        sys.argv = command[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(command[1]))
    return status


def _run_rank(script: str) -> None:
    """Runs the script as __main__, then ends the process as CPython does after a script (see
    the module's docstring), less the finalization."""
    interrupted = False
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except BaseException as error:  # noqa: BLE001 - reported as the interpreter reports it
        sys.excepthook(type(error), error, error.__traceback__)
        interrupted, status = isinstance(error, KeyboardInterrupt), 1
    threading._shutdown()  # noqa: SLF001 - the interpreter's own join of non-daemon threads
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as CPython: an unhandled KeyboardInterrupt ends the process by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


if __name__ == "__main__":
    status = main()
    if status is not None:
        # The launcher has nothing to clean up; tearing down the interpreter with megatron
        # imported takes seconds.
        sys.stdout.flush()
        os._exit(status)
    _run_rank(sys.argv[0])
