"""What fsdp-dtensor-batched-chunk-metadata takes off an fsdp_dtensor save.

    python bench/fsdp_dtensor_save_bench.py [--pairs 3] [--experts 4]

Trains the tiny MoE GPT of the CPU tests (--experts experts, Megatron-FSDP
`optim_grads_params`, SwiGLU, the distributed optimizer, EP1 x ETP2) for one iteration on 4 gloo
ranks through tests/_observed_launch.py and saves it in fsdp_dtensor, with the patch and with
it disabled (MEGATRON_PATCHES_DISABLE), taking turns, --pairs times. From each run: the wall
time of megatron's `preprocess_fsdp_dtensor_state_dict` on its slowest rank and the
collectives it ran on rank 0 (the $CHUNK_DIR observer, which also compares every chunk with
megatron's own: a difference stops the bench), and megatron's save-checkpoint timer (slowest
rank; the preprocessing, DCP's planning and the writes). The ratios are medians over the pairs
of unpatched / patched. Ends with

    fsdp_dtensor save, unpatched / patched: preprocess <x>  save <y>  collectives <a> / <b>

(the collectives grow with the tensors unpatched, with the process groups patched).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from _launch import REPO, launch, tiny_model  # noqa: E402
from timing import SAVE_TIMER  # noqa: E402

PATCH = "fsdp-dtensor-batched-chunk-metadata"


def arguments(experts: int, save: Path) -> list[str]:
    return [*tiny_model(experts), "--use-megatron-fsdp", "--use-distributed-optimizer",
            "--ckpt-format", "fsdp_dtensor", "--moe-token-dispatcher-type", "alltoall",
            "--data-parallel-sharding-strategy", "optim_grads_params",
            "--expert-tensor-parallel-size", "2", "--train-iters", "1", "--save-interval", "1",
            "--save", str(save), "--timing-log-level", "1"]


def one_save(directory: Path, experts: int, patched: bool) -> dict:
    chunks = directory / "chunks"
    chunks.mkdir(parents=True)
    env = {"CHUNK_DIR": str(chunks)}
    if not patched:
        env["MEGATRON_PATCHES_DISABLE"] = PATCH
    log = launch(4, arguments(experts, directory / "ckpt"), env=env,
                 script=REPO / "tests" / "_observed_launch.py", timeout=600).check().log
    ranks = [json.loads(path.read_text()) for path in sorted(chunks.glob("chunks_call0_*.json"))]
    differ = [key for rank in ranks for key in rank["differ"]]
    if len(ranks) != 4 or differ:
        raise SystemExit(f"fsdp_dtensor_save_bench: chunks differ from megatron's: {differ[:5]}")
    save_ms = max(float(found.group(2)) for found in SAVE_TIMER.finditer(log))
    return {"preprocess": max(rank["seconds"] for rank in ranks), "save": save_ms / 1000,
            "collectives": sum(ranks[0]["collectives"].values()), "dtensors": ranks[0]["dtensors"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--experts", type=int, default=4)
    options = parser.parse_args()
    preprocess, save = [], []
    with tempfile.TemporaryDirectory(prefix="fsdp_save_bench_") as root:
        for pair in range(options.pairs):
            runs = {}
            # The order alternates, so that neither mode always runs on a warmer machine.
            for patched in ((True, False) if pair % 2 == 0 else (False, True)):
                mode = "patched" if patched else "unpatched"
                runs[mode] = one_save(Path(root) / f"{pair}-{mode}", options.experts, patched)
                print(f"pair {pair} {mode:9s}: preprocess {runs[mode]['preprocess']:.3f} s, "
                      f"save {runs[mode]['save']:.3f} s, {runs[mode]['collectives']} collectives, "
                      f"{runs[mode]['dtensors']} DTensors", flush=True)
            preprocess.append(runs["unpatched"]["preprocess"] / runs["patched"]["preprocess"])
            save.append(runs["unpatched"]["save"] / runs["patched"]["save"])
    print(f"fsdp_dtensor save, unpatched / patched: preprocess {statistics.median(preprocess):.1f}"
          f"  save {statistics.median(save):.2f}  collectives "
          f"{runs['unpatched']['collectives']} / {runs['patched']['collectives']}")


if __name__ == "__main__":
    main()
