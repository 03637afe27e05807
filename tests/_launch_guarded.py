"""Runs tests/_pretrain_with_guards.py (pretrain_moe.py + checkpoint guards) on 2 gloo ranks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from _checkpoints import ROOT
from _ckpt_worker import _free_port

# A tiny MoE GPT with expert tensor parallelism 2 (EP=1, DP=2) on two CPU ranks.
TINY_ETP2 = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
    "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--bf16",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--expert-tensor-parallel-size", "2", "--ckpt-format", "torch_dist",
]


@dataclasses.dataclass(frozen=True)
class Run:
    returncode: int
    log: str


def launch(args: list[str], timeout: int = 300) -> Run:
    """A hang shows up as subprocess.TimeoutExpired, failing the test."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
               os.path.join(ROOT, "tests", "_pretrain_with_guards.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return Run(done.returncode, done.stdout)
