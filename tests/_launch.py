"""Runs pretrain_moe.py under torchrun on CPU (gloo) and reads what it wrote."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

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


@dataclasses.dataclass
class Run:
    returncode: int
    log: str

    def check(self) -> "Run":
        assert self.returncode == 0, f"launcher failed ({self.returncode}):\n{self.log[-6000:]}"
        return self


def launch(nproc: int, args: list[str], env: dict | None = None, timeout: int = 600,
           script: Path = REPO / "pretrain_moe.py") -> Run:
    # --standalone lets torchrun pick its own free rendezvous port (no races between runs).
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": str(REPO), **(env or {})}
    done = subprocess.run(command, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return Run(done.returncode, done.stdout)


def audit_report(checkpoint: Path) -> dict:
    """The checkpoint audit CLI's JSON report of `checkpoint` (the CLI must say complete)."""
    done = subprocess.run([sys.executable, "-m", "megatron_patches.checkpoint_audit",
                           str(checkpoint), "--json"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout)


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
