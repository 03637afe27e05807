"""`sbatch examples/moe/train.sh` on a real Slurm cluster that the test brings up on this machine.

One module-scoped cluster: munged, slurmctld and two slurmd (two nodes on this host, the first
named after it so that it resolves), Debian's Slurm 22.05 packages, every conf/state/log/pid
path in a temporary folder, SLURM_CONF pointing at a private slurm.conf, the daemons stopped by
their pids at the end. Jobs run the tiny recipe (4 CPU ranks) through train.sh exactly as a
CPU-only user submits it, with shorter schedules (TRAIN_ITERS/SAVE_INTERVAL). Without the
packages the module skips, saying how to install them; in CI (CI=true) it fails instead.

What runs here: sbatch/srun task launch, 1 node x 4 and 2 nodes x 2 tasks (same host),
scontrol requeue, the time-limit signal, the launcher's refusals. What does not: GPUs, NCCL,
pyxis/enroot containers, networking between hosts.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from _required import require

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SH = "examples/moe/train.sh"
PACKAGES = "slurmctld slurmd slurm-client munge"
PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo",
            "squeue", "scancel")
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: ([0-9.E+-]+)")

pytestmark = pytest.mark.slow


def program(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running(pid: int) -> bool:
    """A live process (not a zombie: the daemons' parent may not reap them)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_for(what: str, ready, timeout: float, poll: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [self.host, f"{self.host}-2"]  # the second sorts after the first
        self.spare = f"{self.host}-spare"  # in no partition (State=FUTURE): a job may exclude it
        self.conf = root / "slurm.conf"
        self.pid_files: list[Path] = []

    # -- bring-up ------------------------------------------------------------------------
    def start(self) -> None:
        r = self.root
        for d in ("state", "log", "spool", "munge-key", "out"):
            (r / d).mkdir()
        (r / "munge-key").chmod(0o700)  # munged wants a private key and a socket folder that
        socket_dir = r / "munge"  # everyone may enter (and no group/world-writable parents)
        socket_dir.mkdir(mode=0o755)
        subprocess.run([program("mungekey"), "--create", "--keyfile", str(r / "munge-key/key")],
                       check=True)
        subprocess.run([program("munged"), f"--socket={socket_dir / 'socket'}",
                        f"--key-file={r / 'munge-key/key'}", f"--pid-file={r / 'munged.pid'}",
                        f"--log-file={r / 'log/munged.log'}", f"--seed-file={r / 'munge/seed'}"],
                       check=True)
        self.pid_files.append(r / "munged.pid")
        ctld_port = free_port()
        node_lines = "\n".join(
            f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=8"
            for n in self.nodes)
        # CPUs=8 on a smaller machine: config_overrides lets slurmd use the declared count.
        # MessageTimeout 30 s: while 4 ranks start or save on 2 cores, slurmctld can take more
        # than the default 10 s to answer (a CI run's squeue failed so).
        self.conf.write_text(f"""\
ClusterName=ci
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket_dir / 'socket'}
CredType=cred/munge
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd'}-%n.pid
SlurmctldLogFile={r / 'log/slurmctld.log'}
SlurmdLogFile={r / 'log/slurmd'}-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=120
MessageTimeout=30
{node_lines}
NodeName={self.spare} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={free_port()} State=FUTURE
PartitionName=ci Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        subprocess.run([program("slurmctld"), "-i"], env=self.env(), check=True)
        self.pid_files.append(r / "slurmctld.pid")
        for node in self.nodes:
            subprocess.run([program("slurmd"), "-N", node], env=self.env(), check=True)
            self.pid_files.append(r / f"slurmd-{node}.pid")
        wait_for("both nodes idle", lambda: self.run("sinfo", "-h", "-N", "-o", "%T").stdout
                 .split() == ["idle", "idle"], timeout=60)

    def stop(self) -> None:
        # Jobs first, while slurmd can still end their steps; then the daemons, by their pids.
        if self.conf.exists():
            self.run("scancel", "--full", "--user=root")
            try:
                self.wait_idle(timeout=90)
            except AssertionError:
                pass
        pids = [int(f.read_text().split()[0]) for f in reversed(self.pid_files) if f.exists()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        # slurmctld writes its state as it stops: wait, so that the folder can then be removed.
        try:
            wait_for("the daemons to stop", lambda: not any(map(running, pids)), 30, poll=0.2)
        except AssertionError:
            pass

    # -- use -----------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment without Slurm's or train.sh's variables, plus SLURM_CONF."""
        drop = {"RECIPE", "DRY_RUN", "NODES", "GPUS_PER_NODE", "NPROC", "EXTRA_ARGS", "DATA_PATH",
                "CKPT_DIR", "WANDB_PROJECT", "CONTAINER_IMAGE", "MASTER_ADDR", "MASTER_PORT",
                "WORLD_SIZE", "RANK", "LOCAL_RANK", "MOE_ROOT", "TRAIN_ITERS", "SAVE_INTERVAL",
                "RUN_DIR", "MEGATRON_ARGUMENTS_FILE"}
        env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
        env.update(SLURM_CONF=str(self.conf), PYTHON=sys.executable, PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def run(self, *command: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([program(command[0]) or command[0], *command[1:]], cwd=ROOT,
                              env=self.env(**env), capture_output=True, text=True,
                              timeout=timeout)

    def queue(self, *options: str) -> str | None:
        """What `squeue -h [options]` lists; None when squeue fails (slurmctld busy or timing
        out: the queue is then unknown, not empty)."""
        try:
            listed = self.run("squeue", "-h", *options)
        except subprocess.TimeoutExpired:
            return None
        return listed.stdout.strip() if listed.returncode == 0 else None

    def wait_idle(self, timeout: float) -> None:
        wait_for("an empty queue", lambda: self.queue() == "", timeout)

    def submit(self, name: str, *options: str, wait: bool = False, timeout: float = 600,
               **env: str) -> "Job":
        """sbatch [options] examples/moe/train.sh from the repository root, as a user does.
        Only on an idle cluster: a one-node job then gets the first node, whose name resolves
        (the second's does not, and train.sh refuses it as MASTER_ADDR)."""
        self.wait_idle(timeout=300)
        log = self.root / "out" / f"{name}.out"  # job ids restart at 1 with each fresh cluster
        env.setdefault("RUN_DIR", str(self.root / "runs" / name))  # not the checkout's runs/
        done = self.run("sbatch", "--parsable", "-o", str(log), *options, TRAIN_SH, **env)
        job_id = done.stdout.strip().split(";")[0]
        assert job_id.isdigit(), done.stdout + done.stderr
        job = Job(self, job_id, log, None)
        if wait:  # not `sbatch --wait`, which looks at the job at growing intervals: jobs this
            # polling sees end after 19-30 s returned after 42 s there, those of 3-6 s after 12
            exit_status, signal_number = map(int, job.wait_done(timeout)["ExitCode"].split(":"))
            job.returncode = 128 + signal_number if signal_number else exit_status
        return job


class Job:
    def __init__(self, cluster: Cluster, job_id: str, log: Path, returncode: int | None):
        self.cluster, self.id, self.log_path, self.returncode = cluster, job_id, log, returncode

    @property
    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def state(self) -> dict[str, str]:
        out = self.cluster.run("scontrol", "show", "job", "-o", self.id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def ended(self) -> bool:
        """Whether the job has left the queue (its processes ended). The whole queue is asked:
        `squeue -j` fails for a job slurmctld has already forgotten."""
        listed = self.cluster.queue("-o", "%i")
        return listed is not None and self.id not in listed.split()

    def wait_log(self, pattern: str, timeout: float) -> re.Match:
        """Waits for `pattern` in the log; fails at once, with the log, if the job ends first."""
        def found() -> re.Match | None:
            ended = self.ended()
            match = re.search(pattern, self.log, re.M)  # read after: the last lines count
            assert match or not ended, (f"job {self.id} ended without {pattern!r} in its log "
                                        f"({self.outcome()}):\n{self.log[-4000:]}")
            return match

        return wait_for(f"{pattern!r} in job {self.id}'s log", found, timeout)

    def outcome(self) -> str:
        """What slurmctld says of the job: its state, the reason and the exit code."""
        state = self.state()
        return ", ".join(f"{key}={state.get(key, '?')}"
                         for key in ("JobState", "Reason", "ExitCode", "Restarts"))

    def wait_state(self, *states: str, timeout: float) -> dict[str, str]:
        return wait_for(f"job {self.id} in state {'/'.join(states)}",
                        lambda: (s := self.state()).get("JobState") in states and s, timeout)

    def wait_done(self, timeout: float) -> dict[str, str]:
        """Waits until the job has left the queue (its processes ended); its final state."""
        wait_for(f"job {self.id} to end", self.ended, timeout)
        return self.state()

    def release(self) -> None:
        """A requeued job waits ~2 minutes (Reason=BeginTime); 2 s on, let it start
        (`starttime=now`, which schedules at once). Not sooner: slurmd revoked the job's credential
        as the last attempt ended and refuses a new one made within the same second (its times
        are whole seconds); slurmctld then ends the job unrun ("Killing non-startable batch
        JobId=N: Job credential revoked"), which is what the 2 minutes guard against."""
        self.wait_state("PENDING", timeout=120)
        time.sleep(2)
        done = self.cluster.run("scontrol", "update", f"jobid={self.id}", "starttime=now")
        assert done.returncode == 0, done.stderr


def attempts(log: str) -> list[str]:
    """The log split at train.sh's attempt lines (--open-mode=append keeps them all)."""
    parts = re.split(r"^(?=\[train\.sh\] recipe \S+, job \d+ attempt \d+:)", log, flags=re.M)
    return [p for p in parts if p.startswith("[train.sh] recipe")]


def losses(log: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(3) for m in ITERATION.finditer(log)}


def saved_iteration(ckpt: Path) -> int:
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    missing = [p for p in PROGRAMS if program(p) is None]
    message = None
    if missing:
        message = (f"Slurm is not installed ({', '.join(missing)} missing); install it with "
                   f"`apt-get install -y {PACKAGES}` (.ci/run does this in CI)")
    elif os.geteuid() != 0:
        message = "the test cluster runs its daemons as root (SlurmUser=root); run as root"
    require(message is None, message)
    root = Path(tempfile.mkdtemp(prefix="slurm-ci-"))
    root.chmod(0o755)
    c = Cluster(root)
    try:
        c.start()
        yield c
    except BaseException:
        for log in sorted((root / "log").glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


SHORT = dict(TRAIN_ITERS="6", SAVE_INTERVAL="6")


@pytest.fixture(scope="module")
def one_node_run(cluster):
    """README's CPU-only submission: `sbatch --ntasks-per-node=4 examples/moe/train.sh`."""
    ckpt = cluster.root / "ckpt-1x4"
    job = cluster.submit("1x4", "--ntasks-per-node=4", wait=True, CKPT_DIR=str(ckpt), **SHORT)
    return job, ckpt


def test_one_node_four_tasks_trains_and_saves(cluster, one_node_run):
    job, ckpt = one_node_run
    log = job.log
    assert job.returncode == 0, log[-6000:]
    assert (f"[train.sh] recipe tiny_cpu, job {job.id} attempt 1: 1 node(s), 4 ranks, "
            f"MASTER_ADDR={cluster.host} (the job's first node)") in log
    assert "srun --kill-on-bad-exit=1 bash -c" in log and "--exit-signal-handler" in log
    assert sorted(losses(log)) == list(range(1, 7)), log[-4000:]
    assert saved_iteration(ckpt) == 6 and (ckpt / "iter_0000006").is_dir()
    assert "train.sh: WARNING" not in log


def test_two_nodes_two_tasks_match_one_node_four_tasks(cluster, one_node_run):
    ckpt = cluster.root / "ckpt-2x2"
    job = cluster.submit("2x2", "--nodes=2", "--ntasks-per-node=2", wait=True,
                         CKPT_DIR=str(ckpt), **SHORT)
    log = job.log
    assert job.returncode == 0, log[-6000:]
    assert f"job {job.id} attempt 1: 2 node(s), 4 ranks, MASTER_ADDR={cluster.host}" in log
    assert "train.sh: WARNING" not in log  # the world size matches: no node-count warning
    assert losses(log) == losses(one_node_run[0].log)
    assert saved_iteration(ckpt) == 6
    # The two nodes see one --save (the same filesystem): judged, not refused.
    assert f"{ckpt}: seen by all 2 nodes of the job (one folder, shared)" in log, log[-4000:]
    assert not list(ckpt.glob("_node_view_*"))


def test_a_save_folder_each_node_keeps_apart_is_refused_before_any_work(cluster):
    """Node-local storage: the same --save path names another folder on each node. Simulated
    with a relative CKPT_DIR and a PYTHON wrapper that starts every rank in a folder of its
    own node's (both slurmd run on this host, so their filesystems are one)."""
    views = cluster.root / "node-views"
    for node in cluster.nodes:
        (views / node).mkdir(parents=True)
    wrapper = cluster.root / "python-in-node-folder"
    wrapper.write_text(f"""#!/bin/bash
script=$(realpath "$1"); shift
cd "{views}/$SLURMD_NODENAME"
exec {sys.executable} "$script" "$@"
""")
    wrapper.chmod(0o755)
    # One rank a node (tiny_cpu's EP2 over two data-parallel replicas): the check is a node's.
    job = cluster.submit("node-local", "--nodes=2", "--ntasks-per-node=1", wait=True,
                         NODES="2", GPUS_PER_NODE="1", CKPT_DIR="node-local-ckpt",
                         PYTHON=str(wrapper),
                         MEGATRON_PATCHES_SAVE_VISIBILITY_WAIT_S="2", **SHORT)
    log = job.log
    errors = [line for line in log.splitlines() if "pretrain_moe: error:" in line]
    assert job.returncode != 0 and len(errors) == 1, log[-6000:]
    assert (f"--save node-local-ckpt is not one folder shared by the job's nodes: rank 0 on "
            f"{cluster.nodes[0]} wrote _node_view_" in errors[0]), errors[0]
    assert f"but {cluster.nodes[1]} (1 of 2 nodes) did not see it within 2 s" in errors[0]
    assert "CKPT_DIR" in errors[0] and "Traceback" not in log, log[-6000:]
    assert not ITERATION.search(log)  # refused before iteration 1
    assert sorted(views.rglob("*")) == sorted(views / n for n in cluster.nodes), \
        sorted(views.rglob("*"))  # nothing left behind on either node


def test_resubmitting_a_finished_run_says_so_and_how_to_train_further(cluster, one_node_run):
    job = cluster.submit("finished", "--ntasks-per-node=4", wait=True,
                         CKPT_DIR=str(one_node_run[1]), **SHORT)
    assert job.returncode == 0, job.log
    assert "nothing to train" in job.log and "holds iteration 6" in job.log
    assert "--override-opt_param-scheduler" in job.log and "TRAIN_ITERS" in job.log
    assert "[train.sh] command:" not in job.log  # nothing was started


def test_refusals_before_any_training(cluster):
    # The header's 8 tasks per node for the 4-rank recipe: refused, naming the options to use.
    wrong = cluster.submit("8-tasks", wait=True, CKPT_DIR=str(cluster.root / "unused"))
    assert wrong.returncode == 2, wrong.log
    assert "recipe tiny_cpu runs 4 ranks (1 node(s) x 4), but job" in wrong.log
    assert "has 8 task(s)" in wrong.log and "--ntasks-per-node=4" in wrong.log
    # A first node whose name does not resolve: refused at once instead of a rendezvous hang.
    start = time.monotonic()
    unresolved = cluster.submit("unresolved", "--ntasks-per-node=4", f"-w{cluster.nodes[1]}",
                                wait=True, CKPT_DIR=str(cluster.root / "unused"))
    assert unresolved.returncode == 2, unresolved.log
    assert (f"MASTER_ADDR={cluster.nodes[1]} (the job's first node) does not resolve"
            in unresolved.log) and time.monotonic() - start < 60
    assert not (cluster.root / "unused").exists()


def test_a_container_gets_the_folders_the_job_writes_and_reads_outside_the_checkout(cluster):
    """RUN_DIR and a CKPT_DIR outside both it and the checkout are mounted (made first: the
    container runtime mounts only what exists); the folders of DATA_PATH's blend and
    TOKENIZER_MODEL that this node has are mounted read-only, one that it lacks is left to the
    image (said, not refused); a folder under CONTAINER_MOUNTS is not mounted twice. This cluster
    has no pyxis, so srun refuses the container options after train.sh has shown the command."""
    run_dir, ckpt = cluster.root / "runs" / "container", cluster.root / "elsewhere" / "ckpt"
    extra, data, tokenizer = (cluster.root / name for name in ("mounted", "data", "tokenizer"))
    data.mkdir(exist_ok=True)
    tokenizer.mkdir(exist_ok=True)
    in_image = "/opt/image-data/web_text_document"
    job = cluster.submit("container", "--ntasks-per-node=4", wait=True, CONTAINER_IMAGE="image",
                         CKPT_DIR=str(ckpt), RUN_DIR=str(run_dir),
                         CONTAINER_MOUNTS=f"{extra}:{extra}",
                         DATA_PATH=f"0.5 {data}/a_text_document 0.3 {extra}/b_text_document "
                                   f"0.2 {data}/c_text_document 1e-1 {in_image}",
                         TOKENIZER_MODEL=str(tokenizer),
                         MEGATRON_ARGUMENTS_FILE=str(extra / "args.txt"))
    command = re.search(r"^\[train\.sh\] command: (.*)$", job.log, re.M)
    assert command, job.log[-3000:]
    shown = command.group(1).replace("\\,", ",")  # printf %q escapes the commas
    assert (f"--container-mounts={ROOT}:{ROOT},{extra}:{extra},{run_dir}:{run_dir},"
            f"{ckpt}:{ckpt},{data}:{data}:ro,{tokenizer}:{tokenizer}:ro ") in shown, shown
    assert f"{os.path.dirname(in_image)} is not on this node" in job.log
    assert run_dir.is_dir() and ckpt.is_dir() and job.returncode != 0


def test_dry_run_in_a_job_is_sized_from_the_job(cluster):
    job = cluster.submit("dry", "--nodes=2", "--ntasks-per-node=2", wait=True, DRY_RUN="1")
    assert job.returncode == 0, job.log
    assert (f"[train.sh] recipe tiny_cpu: dry run for 4 ranks (job {job.id}: 2 node(s), "
            "tasks per node 2(x2))") in job.log
    assert "[layout] world=4 " in job.log and "dry run OK" in job.log
    bigger = cluster.submit("dry-6", "--nodes=2", "--ntasks-per-node=3", wait=True, DRY_RUN="1")
    assert bigger.returncode == 2 and "has 6 task(s) on 2 node(s)" in bigger.log, bigger.log


def test_time_limit_saves_first_and_the_requeued_job_continues(cluster):
    ckpt = cluster.root / "ckpt-time-limit"
    job = cluster.submit("time-limit", "--ntasks-per-node=2", "--time=30", "--signal=B:USR1@170",
                         GPUS_PER_NODE="2", CKPT_DIR=str(ckpt), TRAIN_ITERS="1000",
                         SAVE_INTERVAL="1000")
    job.wait_log(r"iteration\s+2/", timeout=420)
    # Once it trains, its time limit comes 2-3 minutes ahead (Slurm counts whole minutes).
    # slurmctld looks every 30 s and sends USR1 up to 30 s after --signal's 170 s before the
    # limit: within about a minute of the update, the limit still 2 minutes off.
    hours, minutes, _ = map(int, job.state()["RunTime"].split(":"))
    minutes += 60 * hours + 3
    update = cluster.run("scontrol", "update", f"jobid={job.id}", f"timelimit={minutes}")
    assert update.returncode == 0, update.stderr
    job.wait_log(r"^\[train\.sh\] requeueing job", timeout=300)
    first = attempts(job.log)[0]
    assert "[train.sh] time limit ahead (USR1)" in first
    saved = int(re.search(r"successfully saved checkpoint from iteration\s+(\d+)", first).group(1))
    assert saved == max(losses(first)) and saved_iteration(ckpt) == saved
    assert cluster.run("scontrol", "update", f"jobid={job.id}", "timelimit=30").returncode == 0
    job.release()
    job.wait_log(rf"iteration\s+{saved + 1}/", timeout=420)
    second = attempts(job.log)[1]
    assert min(losses(second)) == saved + 1
    # `scontrol requeue` mid-run: SIGTERM, the ranks save again; the requeued job is cancelled.
    assert cluster.run("scontrol", "requeue", job.id).returncode == 0
    job.wait_state("PENDING", timeout=300)
    assert "SIGTERM (scancel, requeue or time limit)" in attempts(job.log)[1], job.log[-4000:]
    assert saved_iteration(ckpt) > saved
    assert cluster.run("scancel", job.id).returncode == 0


# Megatron-FSDP's fsdp_dtensor checkpoints keep no rerun state: the rerun on the second node
# starts as a fresh job would and exits 16 again, not 17.
MEGATRON_FSDP = ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                 "--ckpt-format fsdp_dtensor")


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "fsdp_dtensor"])
def test_a_batch_that_fails_on_two_nodes_is_skipped_and_the_job_trains_on(cluster, node_shim,
                                                                           ckpt_format):
    """A NaN loss at iteration 2 in one data-parallel replica's batch (tests/_bad_loss_entry.py,
    rank 1), through train.sh's default --result-rejected-tracker-filename. Attempt 1 reruns it
    in place, megatron saves and exits 16, train.sh holds the job naming the node to exclude;
    released elsewhere, attempt 2 reruns it from the checkpoint and exits 17 (under
    Megatron-FSDP 16 again, its in-place rerun reproducing it on the second node), and train.sh,
    finding that megatron's reading of the tracker skips iteration 2, lifts the first node's
    exclusion (its GPU was not at fault) and requeues; attempt 3 skips it and finishes.
    Megatron reads the node from uname: each rank runs under the shim with its Slurm node's name
    (both slurmd share this host)."""
    fsdp = ckpt_format == "fsdp_dtensor"
    ckpt = cluster.root / f"ckpt-bad-batch-{ckpt_format}"
    run_dir = cluster.root / "runs" / f"bad-batch-{ckpt_format}"
    wrapper = cluster.root / "python-bad-batch"
    wrapper.write_text(f"""#!/bin/bash
shift  # pretrain_moe.py: tests/_bad_loss_entry.py runs it with the NaN
export LD_PRELOAD={node_shim} NODE_SHIM_HOSTNAME=$SLURMD_NODENAME PYTHONPATH={ROOT}
exec {sys.executable} {ROOT / "tests" / "_bad_loss_entry.py"} "$@"
""")
    wrapper.chmod(0o755)
    # MASTER_ADDR: the second node's name does not resolve (Cluster.submit). 2 tasks (EP 2 over
    # two data-parallel replicas): 4 took twice as long over three attempts. The job excludes a
    # node of its own, which train.sh's advice and its lifting of an exclusion keep.
    job = cluster.submit(f"bad-batch-{ckpt_format}", "--ntasks-per-node=2",
                         f"--exclude={cluster.spare}",
                         GPUS_PER_NODE="2", CKPT_DIR=str(ckpt), RUN_DIR=str(run_dir),
                         PYTHON=str(wrapper), MASTER_ADDR="127.0.0.1",
                         BAD_LOSS="nan", BAD_LOSS_AT="2", BAD_LOSS_RANK="1",
                         TRAIN_ITERS="3", SAVE_INTERVAL="100",
                         **({"EXTRA_ARGS": MEGATRON_FSDP} if fsdp else {}))
    first_node, other_node = cluster.nodes
    job.wait_log(r"^\[train\.sh\] iteration 2 gave a NaN/Inf again", timeout=300)
    held = job.wait_state("PENDING", timeout=120)
    log = job.log
    assert (f"[train.sh] iteration 2 gave a NaN/Inf again when megatron reran it on "
            f"{first_node} (exit 16)") in log, log[-6000:]
    hold = (f"scontrol update jobid={job.id} ExcNodeList={cluster.spare},{first_node} && "
            f"scontrol release {job.id}")
    assert hold in log and held["Reason"] == "job_requeued_in_held_state", (held, log[-3000:])
    assert saved_iteration(ckpt) == 1  # megatron's checkpoint to rerun iteration 2 from
    # The user's command from the log; then the job starts without Slurm's 2-minute wait.
    assert cluster.run("bash", "-c", hold).returncode == 0
    job.release()
    second_verdict = (rf"^\[train\.sh\] iteration 2 gave a NaN/Inf again when megatron reran it "
                      rf"on {other_node}" if fsdp else
                      r"^\[train\.sh\] iteration 2 gave a NaN/Inf on a second node")
    job.wait_log(second_verdict, timeout=300)
    job.release()
    assert job.wait_done(timeout=300)["JobState"] == "COMPLETED", job.log[-6000:]
    first, second, third = attempts(job.log)
    assert "First rerun: unexpected result is reproducible" in first
    if fsdp:
        assert "First rerun: unexpected result is reproducible" in second, second[-3000:]
        assert (f"[train.sh] iteration 2 gave a NaN/Inf again when megatron reran it on "
                f"{other_node} (exit 16), as it did on {first_node} (a checkpoint without rerun "
                f"state, as fsdp_dtensor's, gives 16 on the second node too): its batch, not a "
                f"GPU. Requeueing job {job.id}") in second, second[-3000:]
    else:
        assert (f"[train.sh] iteration 2 gave a NaN/Inf on a second node ({other_node}) too: "
                f"its batch, not a GPU (exit 17). Requeueing job {job.id}") in second, \
            second[-3000:]
        assert "Second rerun: unexpected result is reproducible on a different GPU" in second
    # the first node was not at fault: the exclusion the hold's advice added is lifted
    assert (f"[train.sh] {first_node} gave that NaN/Inf too and is not at fault: the job no "
            f"longer excludes it (ExcNodeList={cluster.spare})") in second, second[-3000:]
    assert job.state()["ExcNodeList"] == cluster.spare
    assert "[train.sh] SIGTERM" not in first + second  # no rank was left to save at the hold
    assert "Will skip these iterations from tracker file: [2]" in third, third[-4000:]
    assert sorted(losses(third)) == [3] and saved_iteration(ckpt) == 3, third[-4000:]
    tracker = (run_dir / "rejected_results.txt").read_text()
    assert [re.search(r" rank=(\d+) ", line).group(1) for line in tracker.splitlines()] == \
        ["1"] * (4 if fsdp else 3)
