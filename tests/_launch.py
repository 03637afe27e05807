"""The suite's one multi-process harness: runs pretrain_moe.py (or a test worker) on N CPU ranks
with gloo, in the foreground (launch) or the background (LiveRun), and reads what it wrote.

Ranks are forked by tests/_ranks.py after one import of megatron (see there); torchrun=True runs
the same command under torchrun, for tests whose subject is how the launcher behaves under it.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import glob
import io
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RANKS = REPO / "tests" / "_ranks.py"

# The tiny MoE GPT every CPU test trains (dropout 0 so resumed runs can match bit for bit).
TINY_MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
    "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
    "--moe-aux-loss-coeff", "1e-2",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--bf16",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--log-throughput",
]


def tiny_model(experts: int) -> list[str]:
    """TINY_MODEL with `experts` experts instead of 8."""
    return [str(experts) if previous == "--num-experts" else flag
            for previous, flag in zip(["", *TINY_MODEL], TINY_MODEL)]


def _command(nproc: int, script: Path, args: list[str], torchrun: bool) -> list[str]:
    if torchrun:  # --standalone: torchrun picks its own free rendezvous port
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", str(script), *args]
    return [sys.executable, str(RANKS), str(nproc), str(script), *args]


def _environment(env: dict | None) -> dict:
    # The repository first, then what the caller's path holds (e.g. wheels installed with
    # --target on a GPU machine, bench/gpu_check.sh).
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": path, **(env or {})}


# Where a variable starts so, torch, megatron or the CPU backend may read it on import: a launch
# that sets it otherwise than the rank server was started with gets a launcher of its own.
READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP_", "MKL_", "NVTE_", "CUDA", "PYTHON",
                  "MEGATRON_PATCHES_STRICT", "LD_", "HF_", "TRANSFORMERS", "TOKENIZERS")


def _as_imported(env: dict) -> dict:
    """`env` as importing megatron leaves it: where TORCHINDUCTOR_CACHE_DIR is unset, megatron's
    fusions make torch set it to its default folder, so a launch without it imports as one with
    that folder (a test process that imported megatron has it; each test's environment is put
    back to what it was before, which may not: without this such launches were not served)."""
    if "TORCHINDUCTOR_CACHE_DIR" in env:
        return env
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return {**env, "TORCHINDUCTOR_CACHE_DIR": os.path.abspath(default_cache_dir())}


class _RankServer:
    """tests/_ranks.py --serve, started once per test session; see there."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="ranks-")
        self.path = os.path.join(self.dir, "socket")
        self.env = _environment(None)
        self.proc = subprocess.Popen([sys.executable, str(RANKS), "--serve", self.path],
                                     cwd=REPO, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        atexit.register(self.stop)
        self.served = 0
        self.unserved: collections.Counter[str] = collections.Counter()
        startup = []
        while not startup or startup[-1] != "[ranks] serving\n":
            line = self.proc.stdout.readline()
            assert line, "the rank server did not start:\n" + "".join(startup)[-3000:]
            startup.append(line)

    def stop(self) -> None:
        self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def serves(self, env: dict) -> bool:
        env, server = _as_imported(env), _as_imported(self.env)
        changed = {key for key in {*env, *server} if env.get(key) != server.get(key)}
        read_at_import = sorted(key for key in changed if key.startswith(READ_AT_IMPORT))
        self.unserved.update(read_at_import)
        return self.proc.poll() is None and not read_at_import

    def report(self) -> str:
        """For the end of a run: a launch it did not serve imported torch and megatron again."""
        line = f"rank server: {self.served} launches forked from its one import"
        if self.unserved:
            line += ("; launched on their own, for a differing " +
                     ", ".join(f"{key} ({n})" for key, n in self.unserved.most_common()))
        return line

    def start(self, nproc: int, script: Path, args: list[str], env: dict) -> "_ServedLaunch":
        self.served += 1
        return _ServedLaunch(self.path, {"nproc": nproc, "script": str(script), "args": args,
                                         "env": env, "cwd": str(REPO)})


class _ServedLaunch:
    """A launch the rank server forked: what the harness uses of subprocess.Popen."""

    def __init__(self, path: str, request: dict):
        read_end, write_end = os.pipe()
        self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.connection.connect(path)
        socket.send_fds(self.connection, [json.dumps(request).encode()], [write_end])
        os.close(write_end)
        self.stdout = os.fdopen(read_end, errors="replace")
        self.answers = self.connection.makefile()
        self.pid = int(self.answers.readline())
        self.returncode = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.connection], [], [], 0)[0]:
            self.returncode = int(self.answers.readline())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"launch {self.pid}", timeout)
            self.returncode = int(self.answers.readline())
        return self.returncode


@functools.cache
def _rank_server() -> _RankServer:
    return _RankServer()


def rank_server_report() -> str | None:
    return _rank_server().report() if _rank_server.cache_info().currsize else None


def _start(nproc: int, args: list[str], env: dict | None, script: Path, torchrun: bool,
           preexec=None):
    full_env = _environment(env)
    if not torchrun and preexec is None and _rank_server().serves(full_env):
        return _rank_server().start(nproc, script, args, full_env)
    return subprocess.Popen(_command(nproc, script, args, torchrun), cwd=REPO, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=preexec)


def _kill_group(proc) -> None:
    """Kills a launch: the launcher, its ranks and what they started (a process group of their
    own). Once the launcher has exited only orphans are left: megatron's checkpoint writer starts
    a multiprocessing manager per rank, which outlives a killed rank with ~0.5 GB."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


# How faulthandler (pretrain_moe.py) starts its report of a rank killed by a signal.
FATAL = "Fatal Python error"

# For each launch of the running test that a signal killed: what its ranks printed just before
# the report (glibc's message, the last iterations). A test's own message often quotes only the
# log's tail, which the report's thread stacks fill; tests/conftest.py adds these to the failure.
fatal_reports: list[str] = []


def _from_before(log: str, fatal: int, after: int) -> str:
    """The log around a faulthandler report starting at `fatal`: what the ranks printed just
    before it, and `after` characters of it."""
    return log[max(0, fatal - 1500):fatal + after]


def _note_fatal(log: str) -> None:
    fatal = log.find(FATAL)
    if fatal >= 0:
        fatal_reports.append(_from_before(log, fatal, 200))


@dataclasses.dataclass
class Run:
    returncode: int
    log: str

    def check(self) -> "Run":
        assert self.returncode == 0, f"launcher failed ({self.returncode}):\n{self.failure()}"
        return self

    def failure(self) -> str:
        """The log's tail, and where a rank died of a signal (pretrain_moe.py's faulthandler
        report, whose thread stacks push the cause out of the tail) what it printed first."""
        fatal = self.log.find(FATAL)
        if fatal < 0 or fatal >= len(self.log) - 6000:
            return self.log[-6000:]
        return f"{_from_before(self.log, fatal, 3000)}\n[...]\n{self.log[-3000:]}"

    @property
    def exit_codes(self) -> list[int]:
        """Each rank's exit status (negative: killed by that signal), from tests/_ranks.py."""
        found = re.findall(r"^\[ranks\] exit codes: (.*)$", self.log, flags=re.M)
        assert found, f"no exit codes reported (a torchrun run?):\n{self.log[-3000:]}"
        return [int(code) for code in found[-1].split()]


def launch(nproc: int, args: list[str], env: dict | None = None, timeout: int = 600,
           script: Path = REPO / "pretrain_moe.py", torchrun: bool = False) -> Run:
    run = LiveRun(args, nproc=nproc, script=script, env=env, torchrun=torchrun)
    log = run.finish(timeout)
    return Run(run.proc.returncode, log)


class LiveRun:
    """A launch in the background; its output collected line by line."""

    def __init__(self, args: list[str], nproc: int = 2, preexec=None,
                 script: Path = REPO / "pretrain_moe.py", env: dict | None = None,
                 torchrun: bool = False, cores: set[int] | None = None):
        """cores: the CPUs the ranks run on (set in each rank by tests/_ranks.py, so the launch
        can still be forked from the rank server; a preexec function cannot)."""
        if cores:
            env = {**(env or {}), "RANKS_CPU_AFFINITY": ",".join(map(str, sorted(cores)))}
        self.proc = _start(nproc, args, env, script, torchrun, preexec)
        self.torchrun = torchrun
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def wait_for(self, text: str, times: int, deadline: float) -> bool:
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.count(text) >= times:
                return True
            time.sleep(0.02)
        return self.count(text) >= times

    def ranks(self) -> list[psutil.Process]:
        """The rank processes (the launcher's children)."""
        return psutil.Process(self.proc.pid).children()

    def rank(self, rank: int) -> psutil.Process:
        """One rank's process: as tests/_ranks.py reports it, or under torchrun the worker
        started with that RANK (a forked rank's environment is set after its start, where
        /proc does not show it; a torchrun worker's is its start's)."""
        if self.torchrun:
            workers = [child for child in self.ranks()
                       if child.environ().get("RANK") == str(rank)]
            assert len(workers) == 1, f"torchrun runs no rank {rank}:\n{self.log()[-3000:]}"
            return workers[0]
        found = [line for line in self.lines if line.startswith("[ranks] pids: ")]
        assert found, f"no rank pids reported yet:\n{self.log()[-3000:]}"
        return psutil.Process(int(found[0].split()[2 + rank]))

    def finish(self, timeout: float) -> str:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"run did not stop within {timeout}s:\n{self.log()[-4000:]}")
        self.stop()
        self.reader.join(10)
        log = self.log()
        _note_fatal(log)
        return log

    def stop(self) -> None:
        """Kills what is left of the run."""
        _kill_group(self.proc)

    def log(self) -> str:
        return "".join(self.lines)


def audit_report(checkpoint: Path) -> dict:
    """The checkpoint audit's JSON report of `checkpoint` (it must say complete): the CLI's entry
    point, `--json`, called in this process (a new Python would spend ~3 s importing torch; the
    CLI itself runs in tests/moe_launcher/checkpoint_files/test_checkpoint_audit.py)."""
    from moe_launcher.checkpoint_files.audit import EXIT_COMPLETE, main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main([str(checkpoint), "--json"])
    assert status == EXIT_COMPLETE, printed.getvalue()[-3000:]
    return json.loads(printed.getvalue())


def tensorboard_scalars(tensorboard_dir: Path, tag: str) -> dict[int, float]:
    """The per-iteration values megatron logged under `tag` (iteration -> value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for events in sorted(glob.glob(str(tensorboard_dir / "events.out.tfevents.*"))):
        accumulator = EventAccumulator(events, size_guidance={"scalars": 0})
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            values.update({e.step: e.value for e in accumulator.Scalars(tag)})
    return values


def printed_losses(log: str, key: str = "lm loss") -> dict[int, str]:
    """The `key` megatron printed on each iteration line (iteration -> the printed text, e.g.
    '7.123456E+00'): the mean over the iterations since the previous line; also a count
    megatron pads ('number of skipped iterations': '  1' -> '1')."""
    return {int(iteration): value for iteration, value in re.findall(
        rf"^.* iteration\s+(\d+)/\s*\d+ \|.* {re.escape(key)}:\s+([-+.0-9E]+) \|", log,
        flags=re.M)}
