"""A run's first torch_dist save, with and without sync-save-thread-results-queue.

    python bench/first_save_bench.py [--pairs 3] [--nproc 4] [--rank-server]

Runs the tiny MoE GPT of the CPU tests through pretrain_moe.py (tests/_save_children_entry.py)
under torchrun, as users launch it, with the distributed optimizer, saving at iterations 2 and 4:
with every patch, and with `sync-save-thread-results-queue` left out (MEGATRON_PATCHES_DISABLE),
the two modes taking turns (a pair's first run alternates). Unpatched, megatron starts a
multiprocessing Manager with 'spawn' in every rank at its first save (an interpreter importing
pretrain_moe.py), so that save waits for the ranks' spawns; a later save does not. Reads
megatron's own `save-checkpoint` timer (the slowest rank's) for the first and the second save,
and, after training, the resident memory of the processes each rank has left running.

--rank-server forks the ranks from the test suite's server instead (tests/_ranks.py: megatron
imported once), as tests/bench/test_first_save_bench.py runs it. Ends with

    first save patched/unpatched: <ratio> (<ms> / <ms> ms); second save: <ratio>;
    resident per rank in processes megatron's saves left: <MB> / <MB> MB

(one line; a ratio below 1.00: the patched save is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from _launch import REPO, TINY_MODEL, launch  # noqa: E402
from _save_children_entry import saved_children  # noqa: E402
from timing import SAVE_TIMER  # noqa: E402

PATCH = "sync-save-thread-results-queue"
ENTRY = REPO / "tests" / "_save_children_entry.py"


def one_run(work: str, mode: str, nproc: int, torchrun: bool) -> dict:
    """A run's first and second save (ms, the slowest rank) and the memory its ranks' children
    hold after training (MB, a rank's average)."""
    with tempfile.TemporaryDirectory(dir=work) as ckpt:
        run = launch(nproc, [*TINY_MODEL, "--use-distributed-optimizer", "--train-iters", "4",
                             "--save-interval", "2", "--save", ckpt],
                     env={"MEGATRON_PATCHES_DISABLE": PATCH if mode == "unpatched" else ""},
                     script=ENTRY, torchrun=torchrun, timeout=600)
    if run.returncode != 0:
        sys.exit(f"first_save_bench: the {mode} run failed:\n{run.log[-3000:]}")
    saves = [float(slowest) for _, slowest in SAVE_TIMER.findall(run.log)]
    ranks = saved_children(run.log)
    if len(saves) != 2 or len(ranks) != nproc:
        sys.exit(f"first_save_bench: the {mode} run logged {len(saves)} saves and {len(ranks)} "
                 f"ranks' children, not 2 and {nproc}:\n{run.log[-3000:]}")
    resident = sum(sum(rank["resident_mb"]) for rank in ranks) / nproc
    print(f"{mode:9s} first save {saves[0]:8.1f} ms  second {saves[1]:7.1f} ms  "
          f"left running per rank: {sorted({n for r in ranks for n in r['children']})} "
          f"{resident:.0f} MB", flush=True)
    return {"first": saves[0], "second": saves[1], "resident": resident}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--rank-server", action="store_true",
                        help="fork the ranks from the test suite's server, not torchrun")
    options = parser.parse_args()
    if options.pairs < 1:
        parser.error("--pairs must be at least 1")
    runs = {"patched": [], "unpatched": []}
    with tempfile.TemporaryDirectory(prefix="first_save_") as work:
        for index in range(options.pairs):
            order = ("patched", "unpatched") if index % 2 == 0 else ("unpatched", "patched")
            for mode in order:
                runs[mode].append(one_run(work, mode, options.nproc, not options.rank_server))
    median = {mode: {kind: statistics.median(run[kind] for run in measured)
                     for kind in ("first", "second", "resident")}
              for mode, measured in runs.items()}
    patched, unpatched = median["patched"], median["unpatched"]
    print(f"first save patched/unpatched: {patched['first'] / unpatched['first']:.2f} "
          f"({patched['first']:.0f} / {unpatched['first']:.0f} ms); second save: "
          f"{patched['second'] / unpatched['second']:.2f}; resident per rank in processes "
          f"megatron's saves left: {patched['resident']:.0f} / {unpatched['resident']:.0f} MB")


if __name__ == "__main__":
    main()
