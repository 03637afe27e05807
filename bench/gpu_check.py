"""The prepared GPU check: what CPU tests cannot see, run in one go on a GPU machine.

    bash bench/gpu_check.sh          # (it installs carried wheels if megatron-core is missing)

On one GPU with NCCL and bf16 it trains the tiny MoE through pretrain_moe.py, saves, resumes in a
new process and compares the losses, for megatron's local spec, for Transformer Engine
grouped-GEMM experts where TE imports, and for Megatron-FSDP with fsdp_dtensor checkpoints; it
checks that the layer census, `FLOPs per iteration`, TFLOP/s and MFU lines are logged and the
checkpoint guards are applied, and audits each checkpoint. Without CUDA the same steps run on
the CPU backend where they can, and each step that needs CUDA says SKIP with the reason, so the
script is exercised by CI and does not rot.

Each step prints one line `PASS|SKIP|FAIL <step>: <detail>`; the summary is written to
`bench/results/gpu_check_<device>.txt` (or under $GPU_CHECK_RESULTS). Exit status 1 if any
step failed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from _launch import TINY_MODEL, launch, tensorboard_scalars  # noqa: E402  (the suite's harness)

K = 3  # iterations before the checkpoint; every run goes to 2K
# On CPU the path is deterministic and resumed losses match bit for bit. On a GPU, bf16 kernels
# with atomics (embedding and MoE scatter backward) may differ in the last bits between two
# processes; the loss of a resumed run must then agree to this relative tolerance.
GPU_RELATIVE_TOLERANCE = 1e-3

LOG_LINES = {
    "layer census": re.compile(r"\[megatron_patches\] layer census: "),
    "FLOPs per iteration": re.compile(r"^FLOPs per iteration: \d+", re.M),
    "TFLOP/s": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): [0-9.]+"),
    "save guard applied": re.compile(r"checkpoint-completeness-guard: applied"),
    "load guard applied": re.compile(r"checkpoint-load-guard: applied"),
}
MFU_LINE = re.compile(r" MFU: [0-9.]+% \|")


@dataclasses.dataclass
class Step:
    name: str
    verdict: str  # PASS, SKIP, FAIL
    detail: str

    def line(self) -> str:
        return f"{self.verdict} {self.name}: {self.detail}"


def device_slug() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def transformer_engine_imports() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a TE built for another torch/CUDA fails in many ways on import
        return False
    return True


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


def audit(checkpoint: Path) -> str | None:
    done = subprocess.run([sys.executable, "-m", "megatron_patches.checkpoint_audit",
                           str(checkpoint)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        return f"checkpoint audit exit {done.returncode}: {(done.stdout + done.stderr)[-600:]}"
    return None


def train_save_resume(name: str, flags: list[str], work: Path, logs: Path) -> Step:
    """Trains 2K iterations saving at K, resumes from K in a new process, compares losses."""
    on_gpu = torch.cuda.is_available()
    common = [*TINY_MODEL, *flags, "--train-iters", str(2 * K), "--save-interval", str(K)]
    started = time.perf_counter()
    full = launch(1, [*common, "--save", str(work / name / "full"),
                      "--tensorboard-dir", str(work / name / "tb_full")])
    (logs / f"{name}_full.log").write_text(full.log)
    if full.returncode != 0:
        return Step(name, "FAIL", f"training exited {full.returncode}; see {name}_full.log: "
                    f"{full.log.strip().splitlines()[-1] if full.log.strip() else ''}")
    resumed = launch(1, [*common, "--load", str(work / name / "full"), "--ckpt-step", str(K),
                         "--save", str(work / name / "resumed"),
                         "--tensorboard-dir", str(work / name / "tb_resumed")])
    (logs / f"{name}_resumed.log").write_text(resumed.log)
    if resumed.returncode != 0:
        return Step(name, "FAIL", f"resume exited {resumed.returncode}; see {name}_resumed.log")
    problems = []
    if missing := missing_lines(full.log, on_gpu):
        problems.append(f"log lacks {', '.join(missing)}")
    if difference := losses_agree(tensorboard_scalars(work / name / "tb_full", "lm loss"),
                                  tensorboard_scalars(work / name / "tb_resumed", "lm loss"),
                                  exact=not on_gpu):
        problems.append(difference)
    if finding := audit(work / name / "full"):
        problems.append(finding)
    if problems:
        return Step(name, "FAIL", "; ".join(problems))
    mfu = MFU_LINE.search(full.log)
    return Step(name, "PASS", f"trained, saved at {K}, resumed to {2 * K} with "
                f"{'equal' if not on_gpu else 'matching'} losses, audit complete"
                f"{'; ' + mfu.group(0).strip(' |') if mfu else ''} "
                f"({time.perf_counter() - started:.0f} s)")


def run_checks(work: Path, logs: Path) -> list[Step]:
    on_gpu = torch.cuda.is_available()
    have_te = transformer_engine_imports()
    steps = [Step("environment", "PASS",
                  f"torch {torch.__version__}, CUDA {torch.version.cuda}, device "
                  f"{torch.cuda.get_device_name() if on_gpu else 'none (CPU backend)'}, "
                  f"Transformer Engine {'imports' if have_te else 'absent'}")]
    dist_opt = ["--use-distributed-optimizer", "--ckpt-format", "torch_dist",
                "--moe-token-dispatcher-type", "alltoall"]
    steps.append(train_save_resume("local-spec", [*dist_opt, "--transformer-impl", "local"],
                                   work, logs))
    if on_gpu and have_te:
        steps.append(train_save_resume("te-grouped-gemm", [
            *dist_opt, "--transformer-impl", "transformer_engine", "--moe-grouped-gemm"],
            work, logs))
    else:
        steps.append(Step("te-grouped-gemm", "SKIP", "needs CUDA and Transformer Engine"
                          if not on_gpu else "Transformer Engine does not import here"))
    if on_gpu:
        steps.append(train_save_resume("megatron-fsdp", [
            "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
            "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
            "--moe-token-dispatcher-type", "alltoall"], work, logs))
    else:
        steps.append(Step("megatron-fsdp", "SKIP", "needs CUDA (NCCL, bf16 Megatron-FSDP "
                          "buffers); its CPU runs are the test suite's"))
    return steps


def main() -> int:
    results = Path(os.environ.get("GPU_CHECK_RESULTS", REPO / "bench" / "results"))
    results.mkdir(parents=True, exist_ok=True)
    slug = device_slug()
    logs = results / f"gpu_check_{slug}_logs"
    logs.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        steps = run_checks(Path(work), logs)
    lines = [f"gpu_check on {slug} ({time.strftime('%Y-%m-%d %H:%M:%S %Z')})"]
    lines += [step.line() for step in steps]
    failed = [step for step in steps if step.verdict == "FAIL"]
    lines.append(f"{sum(s.verdict == 'PASS' for s in steps)} passed, {len(failed)} failed, "
                 f"{sum(s.verdict == 'SKIP' for s in steps)} skipped")
    text = "\n".join(lines) + "\n"
    (results / f"gpu_check_{slug}.txt").write_text(text)
    print(text, end="", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
