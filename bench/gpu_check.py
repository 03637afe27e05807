"""The prepared GPU check: what CPU tests cannot see, run in one go on a GPU machine.

    bash bench/gpu_check.sh          # (it installs carried wheels if megatron-core is missing)

Every launch is `python -m torch.distributed.run --standalone --nproc-per-node 1` in a fresh
process (never forked from one where CUDA is initialised). Each step has its own budget
(STEP_SECONDS): a step starts only while the check's budget ($GPU_CHECK_SECONDS, default 330)
still holds all of it, else it is NOT RUN saying so, so the check ends by then; a step whose
launches run past its own budget FAILs, named. With the offline install, the whole check fits in
6 minutes on the H200, half of a 15-minute device window. The launches keep the PYTHONPATH they
were given (the prepared wheels) and share one inductor cache: megatron's fusions are
torch.compile'd, they compile on the GPU in the first launch and load from the cache in later
ones (on the CPU backend torch.compile runs eagerly); the environment step says which.

Steps, in order:

* environment: torch, CUDA, the device, and whether Transformer Engine imports (in a subprocess:
  a TE built for another torch or CUDA fails in many ways, some fatal).
* cpu-reference: the tiny MoE (tests/_launch.py TINY_MODEL, local spec) on the CPU backend, also
  on a GPU machine (CUDA hidden): the layer census, parameter total and `FLOPs per iteration` it
  logs are the figures every later run of the same model must log, and torch's FlopCounterMode
  must count what the census predicts for one micro-batch (tests/_observed_launch.py
  $FLOP_COUNT_FILE, as tests/megatron_patches/accounting/test_flops.py does in process).
* flop-counter-cuda: the same launch on the GPU: FlopCounterMode on CUDA against the census, and
  the figures against the CPU reference.
* local-spec, te-grouped-gemm, megatron-fsdp: trains 2K iterations saving at K, resumes from K in
  a new process; the logged figures equal the CPU reference, the log has the census, FLOPs,
  TFLOP/s (and on a GPU MFU) lines and the checkpoint guards, the optimizer state loaded equals
  the state saved bit for bit (the save/load path is deterministic everywhere), the resumed
  losses equal the uninterrupted ones (bit for bit on CPU; on a GPU to GPU_RELATIVE_TOLERANCE),
  and the checkpoint audit says complete.
* strict-device-nccl: tests/_strict_device_worker.py at world size 1 on the CPU backend in strict
  device mode and on the GPU with NCCL: every case NCCL refuses, strict mode refuses, and no
  other.
* throughput: a GPU-bound MoE (THROUGHPUT_MODEL) with the patches and with every patch disabled
  through MEGATRON_PATCHES_DISABLE (but KEPT_UNPATCHED); prints
  `gpu throughput ratio patched/unpatched: <r>` (step time unpatched / patched).
* fused-accumulation: `pytest -m gpu` of test_fused_accumulation_keeps_every_micro_batch
  (tests/megatron_patches/fsdp/test_fsdp_microbatch_grads_cpu.py) in a subprocess; its skips are
  NOT RUN with pytest's reason.

Without CUDA the steps that need it say `NOT RUN <step>: needs CUDA`; the rest run the same
code on the CPU backend, so CI exercises the script (tests/bench/test_gpu_check.py). Each step
prints one line `PASS|FAIL|NOT RUN <step>: <detail>`; the last line is
`gpu_check: <n> passed, <m> failed, <k> not run`, followed by `; TE step not run: <why>` when the
Transformer Engine step did not run. The lines go to `bench/results/gpu_check_<device>.txt` (or
under $GPU_CHECK_RESULTS), the launches' logs beside it. Exit status 1 if any step failed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from _launch import TINY_MODEL, tensorboard_scalars  # noqa: E402  (the suite's model and reader)

OBSERVED = REPO / "tests" / "_observed_launch.py"
STRICT_WORKER = REPO / "tests" / "_strict_device_worker.py"
FUSED_TEST = ("tests/megatron_patches/fsdp/test_fsdp_microbatch_grads_cpu.py"
              "::test_fused_accumulation_keeps_every_micro_batch")

K = 3  # iterations before the checkpoint; every run goes to 2K
# On CPU the path is deterministic and resumed losses match bit for bit. On a GPU, bf16 kernels
# with atomics (embedding and MoE scatter backward) may differ in the last bits between two
# processes; the loss of a resumed run must then agree to this relative tolerance.
GPU_RELATIVE_TOLERANCE = 1e-3
# FlopCounterMode counts every matmul; the census formula leaves out norms, softmax and
# activations (test_flops.py's tolerance).
FLOP_COUNTER_TOLERANCE = 0.01
# Each step's budget in seconds: its launches, audit and comparisons together. A tiny launch
# takes ~15 s on 2 CPU cores (local-spec's two launches and audit 31 s); on a GPU add CUDA's
# start and the first launch's compilation.
STEP_SECONDS = {
    "cpu-reference": 45, "flop-counter-cuda": 60, "local-spec": 100, "strict-device-nccl": 45,
    "te-grouped-gemm": 120, "megatron-fsdp": 100, "throughput": 100, "fused-accumulation": 60,
}
CHECK_SECONDS = 330
TE_IMPORT_SECONDS = 60

DISTRIBUTED_OPTIMIZER = ["--use-distributed-optimizer", "--ckpt-format", "torch_dist",
                         "--moe-token-dispatcher-type", "alltoall"]
LOCAL_SPEC = ["--transformer-impl", "local", *DISTRIBUTED_OPTIMIZER]
TE_GROUPED_GEMM = ["--transformer-impl", "transformer_engine", "--moe-grouped-gemm",
                   *DISTRIBUTED_OPTIMIZER]
MEGATRON_FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                 "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
                 "--moe-token-dispatcher-type", "alltoall"]

# Hidden 1024, 8 experts, bf16, 32 sequences of 2048 tokens per step (8 micro-batches): ~40
# TFLOP per step, a few hundred ms on one H200, so the step time is the GPU's, not the launcher's.
THROUGHPUT_MODEL = [
    "--num-layers", "8", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
    "--num-attention-heads", "16", "--seq-length", "2048", "--max-position-embeddings", "2048",
    "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "2048",
    "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
    "--micro-batch-size", "4", "--global-batch-size", "32", "--lr", "1e-4", "--bf16",
    "--use-distributed-optimizer", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "32768", "--train-iters", "12", "--log-interval", "1", "--eval-iters", "0",
    "--eval-interval", "1000", "--log-throughput",
]
THROUGHPUT_WARMUP = 4  # iterations left out of the median step time
# Patches the unpatched run keeps: without them no run starts at all.
KEPT_UNPATCHED = {
    "dataset-helpers-prebuilt": "megatron would run make in the wheel's datasets folder, which "
                                "has no Makefile, and exit",
}

LOG_LINES = {
    "layer census": re.compile(r"\[megatron_patches\] layer census: "),
    "FLOPs per iteration": re.compile(r"^FLOPs per iteration: \d+", re.M),
    "TFLOP/s": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): [0-9.]+"),
    "save guard applied": re.compile(r"checkpoint-completeness-guard: applied"),
    "load guard applied": re.compile(r"checkpoint-load-guard: applied"),
}
MFU_LINE = re.compile(r" MFU: [0-9.]+% \|")
FIGURES = {
    "census": re.compile(r"^\[megatron_patches\] layer census: (.*)$", re.M),
    "parameters": re.compile(r"^\[megatron_patches\] parameters of the model built: total (\d+)",
                             re.M),
    "FLOPs per iteration": re.compile(r"^FLOPs per iteration: (\d+)$", re.M),
}
PATCH_STATUS = re.compile(r"^\[megatron_patches\] ([a-z0-9-]+): (?:applied|skipped)", re.M)
STEP_TIME = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.* elapsed time per iteration \(ms\): "
                       r"([0-9.]+) \|")
STRICT_REFUSAL = "NCCL would refuse a host tensor"  # strict mode's words (cpu_backend)
VERDICT = re.compile(r"^case (.+?): (passed|refused: .*)$", re.M)


@dataclasses.dataclass
class Step:
    name: str
    verdict: str  # PASS, FAIL, NOT RUN
    detail: str

    def line(self) -> str:
        return f"{self.verdict} {self.name}: {self.detail}"


class StepFailed(Exception):
    """A step's FAIL, with what failed."""


class Budget:
    """The check's seconds, and the running step's: a launch gets what is left of its step's."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.step_deadline = self.deadline

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def start_step(self, seconds: float) -> None:
        self.step_deadline = time.monotonic() + seconds

    def timeout(self) -> float:
        return max(1.0, self.step_deadline - time.monotonic())


@dataclasses.dataclass
class Check:
    """What every step shares: where logs go, the time left, the device."""

    work: Path
    logs: Path
    budget: Budget
    on_gpu: bool

    def environment(self, extra: dict | None = None, cpu_backend: bool = False) -> dict:
        # The repository first, then the PYTHONPATH given (carried wheels), never replaced.
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path,
               "TORCHINDUCTOR_CACHE_DIR": str(self.work / "inductor_cache")}
        env.setdefault("OMP_NUM_THREADS", "1")  # as the test suite runs its CPU ranks
        if cpu_backend:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU backend, also on a GPU machine
        return {**env, **(extra or {})}

    def run(self, what: str, command: list[str], log_name: str, env: dict) -> str:
        """Runs `command` in a process group of its own, its output to logs/log_name (a file,
        not a pipe: a process the launch leaves behind cannot hold the check up). Raises
        StepFailed naming `what` when it runs past its step's budget or exits non-zero."""
        timeout = self.budget.timeout()
        with open(self.logs / log_name, "wb") as out:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            # What the launch left running goes with it (megatron's checkpoint writer starts a
            # manager process per rank that can outlive the rank).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        log = (self.logs / log_name).read_text(errors="replace")
        if timed_out:
            raise StepFailed(f"{what} ran past the step's budget ({timeout:.0f} s left of it); "
                             f"see {log_name}")
        if proc.returncode != 0:
            last = log.strip().splitlines()[-1] if log.strip() else ""
            raise StepFailed(f"{what} exited {proc.returncode}; see {log_name}: {last[-300:]}")
        return log

    def torchrun(self, what: str, script: Path, args: list[str], log_name: str,
                 env: dict | None = None, cpu_backend: bool = False) -> str:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "1", str(script), *args]
        return self.run(what, command, log_name, self.environment(env, cpu_backend))


def device_slug() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def transformer_engine_problem(on_gpu: bool) -> str | None:
    """None when Transformer Engine imports here, else why its step cannot run."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed"
    if not on_gpu:
        return "needs CUDA"
    try:
        done = subprocess.run([sys.executable, "-c", "import transformer_engine.pytorch"],
                              capture_output=True, text=True, timeout=TE_IMPORT_SECONDS)
    except subprocess.TimeoutExpired:
        return f"import transformer_engine.pytorch did not finish in {TE_IMPORT_SECONDS} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"import transformer_engine.pytorch failed: {last[-300:]}"
    return None


def logged_figures(log: str) -> dict[str, str]:
    """The census, parameter total and FLOPs per iteration a run logged (first of each)."""
    return {name: found.group(1).strip() for name, pattern in FIGURES.items()
            if (found := pattern.search(log))}


def figures_differ(log: str, reference: dict[str, str] | None) -> str | None:
    if reference is None:
        return "no CPU reference figures to compare with (cpu-reference failed)"
    figures = logged_figures(log)
    if missing := [name for name in FIGURES if name not in figures]:
        return f"log lacks the {', '.join(missing)} figure(s)"
    differing = [f"{name} {figures[name]!r} != CPU's {reference[name]!r}"
                 for name in FIGURES if figures[name] != reference[name]]
    return "; ".join(differing) or None


def flop_count_differs(path: Path) -> tuple[str | None, str]:
    """(what is wrong or None, a summary) of one $FLOP_COUNT_FILE."""
    if not path.is_file():
        return "the launch wrote no FlopCounterMode count", ""
    counted = json.loads(path.read_text())
    measured, predicted = counted["flop_counter"], counted["census"]
    summary = (f"FlopCounterMode on {counted['device']}: {measured} FLOPs per micro-batch, "
               f"census {predicted:.0f}")
    if abs(predicted - measured) > FLOP_COUNTER_TOLERANCE * measured:
        return f"{summary}: off by more than {FLOP_COUNTER_TOLERANCE:.0%}", summary
    return None, summary


def missing_lines(log: str, on_gpu: bool) -> list[str]:
    missing = [name for name, pattern in LOG_LINES.items() if not pattern.search(log)]
    if on_gpu and not MFU_LINE.search(log):
        missing.append("MFU")
    return missing


def losses_agree(full: dict[int, float], resumed: dict[int, float], exact: bool) -> str | None:
    """None when the resumed run's losses equal the uninterrupted ones, else what differs."""
    if sorted(resumed) != list(range(K + 1, 2 * K + 1)):
        return f"resumed run logged iterations {sorted(resumed)}, expected {K + 1}..{2 * K}"
    for iteration, loss in resumed.items():
        reference = full.get(iteration)
        if reference is None:
            return f"uninterrupted run has no loss at iteration {iteration}"
        if exact and loss != reference:
            return f"iteration {iteration}: resumed {loss!r} != uninterrupted {reference!r}"
        if not exact and abs(loss - reference) > GPU_RELATIVE_TOLERANCE * abs(reference):
            return (f"iteration {iteration}: resumed {loss!r} vs uninterrupted {reference!r} "
                    f"(relative tolerance {GPU_RELATIVE_TOLERANCE})")
    return None


def state_differs(saved: Path, loaded: Path) -> str | None:
    """None when the optimizer state loaded equals the state saved bit for bit (the snapshots
    of tests/_observed_launch.py $SNAPSHOT_DIR), else what differs."""
    if not saved.is_file() or not loaded.is_file():
        return f"no optimizer snapshot {saved.name if not saved.is_file() else loaded.name}"
    at_save = torch.load(saved, map_location="cpu", weights_only=True)
    after_load = torch.load(loaded, map_location="cpu", weights_only=True)
    if not at_save:
        return "the optimizer snapshot at save is empty"
    if at_save.keys() != after_load.keys():
        return "optimizer state keys differ after the load"
    differing = [key for key, value in at_save.items() if not torch.equal(value, after_load[key])]
    if differing:
        return f"{len(differing)} optimizer state tensors differ after the load, e.g. {differing[0]}"
    return None


def audit(check: Check, name: str, checkpoint: Path) -> str | None:
    try:
        check.run(f"checkpoint audit of {checkpoint.name}",
                  [sys.executable, "-m", "megatron_patches.checkpoint_audit", str(checkpoint)],
                  f"{name}_audit.log", check.environment())
    except StepFailed as failure:
        return str(failure)
    return None


def cpu_reference(check: Check) -> tuple[Step, dict[str, str]]:
    """The tiny MoE on the CPU backend, and the figures later runs of it must log."""
    counted = check.work / "flops_cpu.json"
    log = check.torchrun("CPU reference launch", OBSERVED,
                         [*TINY_MODEL, *LOCAL_SPEC, "--train-iters", "1"], "cpu-reference.log",
                         env={"FLOP_COUNT_FILE": str(counted)}, cpu_backend=True)
    figures = logged_figures(log)
    if missing := [name for name in FIGURES if name not in figures]:
        raise StepFailed(f"the CPU run logged no {', '.join(missing)} figure(s)")
    problem, summary = flop_count_differs(counted)
    if problem:
        raise StepFailed(problem)
    detail = (f"census {figures['census']!r}, {figures['parameters']} parameters, "
              f"{figures['FLOPs per iteration']} FLOPs per iteration; {summary}")
    return Step("cpu-reference", "PASS", detail), figures


def flop_counter_cuda(check: Check, reference: dict[str, str] | None) -> Step:
    counted = check.work / "flops_cuda.json"
    log = check.torchrun("CUDA launch", OBSERVED,
                         [*TINY_MODEL, *LOCAL_SPEC, "--train-iters", "1"],
                         "flop-counter-cuda.log", env={"FLOP_COUNT_FILE": str(counted)})
    problem, summary = flop_count_differs(counted)
    problems = [p for p in (problem, figures_differ(log, reference)) if p]
    if problems:
        return Step("flop-counter-cuda", "FAIL", "; ".join(problems))
    return Step("flop-counter-cuda", "PASS", f"{summary}; census, parameters and FLOPs per "
                "iteration equal the CPU reference")


def train_save_resume(check: Check, name: str, flags: list[str],
                      reference: dict[str, str] | None) -> Step:
    """Trains 2K iterations saving at K, resumes from K in a new process, compares."""
    root = check.work / name
    snapshots = {run: root / f"snapshots_{run}" for run in ("full", "resumed")}
    for directory in snapshots.values():
        directory.mkdir(parents=True)
    common = [*TINY_MODEL, *flags, "--train-iters", str(2 * K), "--save-interval", str(K)]
    full = check.torchrun(
        "training", OBSERVED, [*common, "--save", str(root / "full"),
                               "--tensorboard-dir", str(root / "tb_full")],
        f"{name}_full.log", env={"SNAPSHOT_DIR": str(snapshots["full"])})
    check.torchrun(
        "resume", OBSERVED, [*common, "--load", str(root / "full"), "--ckpt-step", str(K),
                             "--save", str(root / "resumed"),
                             "--tensorboard-dir", str(root / "tb_resumed")],
        f"{name}_resumed.log", env={"SNAPSHOT_DIR": str(snapshots["resumed"])})
    problems = []
    if missing := missing_lines(full, check.on_gpu):
        problems.append(f"log lacks {', '.join(missing)}")
    problems.append(figures_differ(full, reference))
    problems.append(state_differs(snapshots["full"] / f"save{K}_rank0.pt",
                                  snapshots["resumed"] / "load_rank0.pt"))
    problems.append(losses_agree(tensorboard_scalars(root / "tb_full", "lm loss"),
                                 tensorboard_scalars(root / "tb_resumed", "lm loss"),
                                 exact=not check.on_gpu))
    problems.append(audit(check, name, root / "full"))
    if problems := [problem for problem in problems if problem]:
        return Step(name, "FAIL", "; ".join(problems))
    mfu = MFU_LINE.search(full)
    return Step(name, "PASS", f"figures equal the CPU reference; saved at {K}, optimizer state "
                f"loaded bit-exact, resumed to {2 * K} with "
                f"{'equal' if not check.on_gpu else 'matching'} losses, audit complete"
                f"{'; ' + mfu.group(0).strip(' |') if mfu else ''}")


def strict_verdicts(log: str) -> dict[str, str]:
    verdicts = dict(VERDICT.findall(log))
    if not verdicts:
        raise StepFailed("the strict-device worker printed no verdicts")
    return verdicts


def strict_device_nccl(check: Check) -> Step:
    """Host tensor refused by NCCL <=> refused by strict mode, case by case, at world size 1."""
    strict = strict_verdicts(check.torchrun(
        "strict-mode launch", STRICT_WORKER, [], "strict-device-cpu.log",
        env={"MEGATRON_PATCHES_STRICT_DEVICE": "1"}, cpu_backend=True))
    strict_refuses = {case for case, verdict in strict.items() if STRICT_REFUSAL in verdict}
    if not check.on_gpu:
        return Step("strict-device-nccl", "NOT RUN", f"needs CUDA (strict mode ran: refuses "
                    f"{len(strict_refuses)} of {len(strict)} cases)")
    nccl = strict_verdicts(check.torchrun("NCCL launch", STRICT_WORKER, [],
                                          "strict-device-nccl.log"))
    if nccl.keys() != strict.keys():
        return Step("strict-device-nccl", "FAIL", f"cases differ: NCCL ran {sorted(nccl)}, "
                    f"strict mode {sorted(strict)}")
    nccl_refuses = {case for case, verdict in nccl.items() if verdict.startswith("refused")}
    disagreements = [f"{case!r}: NCCL {nccl[case][:160]!r}, strict mode {strict[case][:160]!r}"
                     for case in sorted(nccl_refuses ^ strict_refuses)]
    if disagreements:
        return Step("strict-device-nccl", "FAIL", "; ".join(disagreements))
    return Step("strict-device-nccl", "PASS", f"NCCL refuses the {len(nccl_refuses)} host-tensor "
                f"cases strict mode refuses and passes the other {len(nccl) - len(nccl_refuses)}")


def median_step_ms(log: str) -> float:
    times = [float(ms) for iteration, ms in STEP_TIME.findall(log)
             if int(iteration) > THROUGHPUT_WARMUP]
    if not times:
        raise StepFailed(f"no step times logged after iteration {THROUGHPUT_WARMUP}")
    return statistics.median(times)


def throughput(check: Check) -> Step:
    patched_log = check.torchrun("patched throughput launch", REPO / "pretrain_moe.py",
                                 THROUGHPUT_MODEL, "throughput_patched.log")
    patched = median_step_ms(patched_log)
    # Every patch the run reported, applied or skipped, by the names it printed them under.
    unpatched_names = [name for name in dict.fromkeys(PATCH_STATUS.findall(patched_log))
                       if name not in KEPT_UNPATCHED]
    unpatched = median_step_ms(check.torchrun(
        "unpatched throughput launch", REPO / "pretrain_moe.py", THROUGHPUT_MODEL,
        "throughput_unpatched.log", env={"MEGATRON_PATCHES_DISABLE": ",".join(unpatched_names)}))
    ratio = unpatched / patched
    print(f"gpu throughput ratio patched/unpatched: {ratio:.3f}", flush=True)
    kept = ", ".join(f"{name} ({why})" for name, why in KEPT_UNPATCHED.items())
    return Step("throughput", "PASS", f"gpu throughput ratio patched/unpatched: {ratio:.3f} "
                f"(median step {patched:.1f} ms patched, {unpatched:.1f} ms with "
                f"{len(unpatched_names)} patches disabled; kept {kept})")


def fused_accumulation(check: Check) -> Step:
    name = "fused-accumulation"
    try:
        log = check.run("pytest", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs",
                                   "-p", "no:cacheprovider", FUSED_TEST],
                        f"{name}_pytest.log", check.environment())
    except StepFailed as failure:
        return Step(name, "FAIL", str(failure))
    summary = log.strip().splitlines()[-1] if log.strip() else ""
    reasons = sorted(set(re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", log, re.M)))
    if " passed" in summary and "skipped" not in summary:
        return Step(name, "PASS", summary.strip("= "))
    if reasons and " passed" not in summary:
        return Step(name, "NOT RUN", f"{'; '.join(reasons)} (pytest skipped it)")
    return Step(name, "FAIL", f"pytest: {summary.strip('= ')}; see {name}_pytest.log")


def report(step: Step) -> Step:
    print(step.line(), flush=True)
    return step


def run_step(check: Check, name: str, step, needs_cuda: bool = False) -> Step:
    """One step's verdict, printed as it comes: its own or FAIL with what failed, with the
    seconds it took of its budget; NOT RUN where it needs CUDA and there is none, or where the
    check's budget no longer holds the step's."""
    if needs_cuda and not check.on_gpu:
        return report(Step(name, "NOT RUN", "needs CUDA"))
    seconds = STEP_SECONDS[name]
    if check.budget.left() < seconds:
        return report(Step(name, "NOT RUN", f"its budget of {seconds} s no longer fits: "
                           f"{max(0.0, check.budget.left()):.0f} s left of the check's "
                           f"{check.budget.seconds:.0f} s ($GPU_CHECK_SECONDS)"))
    check.budget.start_step(seconds)
    started = time.monotonic()
    try:
        verdict = step()
    except StepFailed as failure:
        verdict = Step(name, "FAIL", str(failure))
    if verdict.verdict != "NOT RUN":
        verdict.detail += f" ({time.monotonic() - started:.0f} s of its {seconds} s)"
    return report(verdict)


def run_checks(check: Check) -> tuple[list[Step], str | None]:
    """The steps' verdicts, and why the Transformer Engine step did not run (None if it ran)."""
    te_problem = transformer_engine_problem(check.on_gpu)
    compiled = ("megatron's torch.compile'd fusions compile in the first GPU launch, later "
                "launches load them from one inductor cache" if check.on_gpu else
                "torch.compile runs eagerly on the CPU backend")
    steps = [report(Step("environment", "PASS",
                         f"torch {torch.__version__}, CUDA {torch.version.cuda}, device "
                         f"{torch.cuda.get_device_name() if check.on_gpu else 'none (CPU backend)'}"
                         f", Transformer Engine: {te_problem or 'imports'}; {compiled}"))]
    found = {}  # the CPU reference's figures, once it passed

    def reference() -> Step:
        step, found["figures"] = cpu_reference(check)
        return step

    steps.append(run_step(check, "cpu-reference", reference))
    figures = found.get("figures")
    steps.append(run_step(check, "flop-counter-cuda", lambda: flop_counter_cuda(check, figures),
                          needs_cuda=True))
    steps.append(run_step(check, "local-spec", lambda: train_save_resume(
        check, "local-spec", LOCAL_SPEC, figures)))
    steps.append(run_step(check, "strict-device-nccl", lambda: strict_device_nccl(check)))
    if te_problem is None:
        steps.append(run_step(check, "te-grouped-gemm", lambda: train_save_resume(
            check, "te-grouped-gemm", TE_GROUPED_GEMM, figures)))
        if steps[-1].verdict == "NOT RUN":
            te_problem = steps[-1].detail
    else:
        steps.append(report(Step("te-grouped-gemm", "NOT RUN", te_problem)))
    steps.append(run_step(check, "megatron-fsdp", lambda: train_save_resume(
        check, "megatron-fsdp", MEGATRON_FSDP, figures), needs_cuda=True))
    steps.append(run_step(check, "throughput", lambda: throughput(check), needs_cuda=True))
    steps.append(run_step(check, "fused-accumulation", lambda: fused_accumulation(check)))
    return steps, te_problem


def summary_line(steps: list[Step], te_problem: str | None) -> str:
    counts = {verdict: sum(step.verdict == verdict for step in steps)
              for verdict in ("PASS", "FAIL", "NOT RUN")}
    line = (f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, "
            f"{counts['NOT RUN']} not run")
    return line + (f"; TE step not run: {te_problem}" if te_problem else "")


def main() -> int:
    results = Path(os.environ.get("GPU_CHECK_RESULTS", REPO / "bench" / "results"))
    results.mkdir(parents=True, exist_ok=True)
    slug = device_slug()
    logs = results / f"gpu_check_{slug}_logs"
    logs.mkdir(exist_ok=True)
    budget = Budget(float(os.environ.get("GPU_CHECK_SECONDS", CHECK_SECONDS)))
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        steps, te_problem = run_checks(Check(Path(work), logs, budget, torch.cuda.is_available()))
    lines = [f"gpu_check on {slug} ({time.strftime('%Y-%m-%d %H:%M:%S %Z')})"]
    lines += [step.line() for step in steps]
    lines.append(summary_line(steps, te_problem))
    (results / f"gpu_check_{slug}.txt").write_text("\n".join(lines) + "\n")
    print(lines[-1], flush=True)
    return 1 if any(step.verdict == "FAIL" for step in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
