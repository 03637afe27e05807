"""pretrain_moe.py that prints, on every rank once training (and its saves) is done, the child
processes this rank has left running, by multiprocessing's names, and the memory each holds
(resident, MB), as one JSON object:
`save-children {"rank": <r>, "children": [<names>], "resident_mb": [<MB>]}` (run by
test_sync_save_cpu.py and bench/first_save_bench.py; tests/_sync_save_worker.py prints the same;
the ranks share one pipe, so a rank's object may land inside another's line)."""

import json
import multiprocessing
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pretrain_moe  # noqa: E402


def saved_children(log: str) -> list[dict]:
    """Every rank's object from a run's log, wherever it landed."""
    return [json.loads(found) for found in re.findall(r"save-children (\{[^{}]*\})", log)]


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        kb = next(line.split()[1] for line in status if line.startswith("VmRSS:"))
    return round(int(kb) / 1024, 1)


def print_children() -> None:
    """This rank's object: the child processes it has left running."""
    children = sorted(multiprocessing.active_children(), key=lambda process: process.name)
    print("save-children " + json.dumps({
        "rank": int(os.environ["RANK"]), "children": [process.name for process in children],
        "resident_mb": [resident_mb(process.pid) for process in children]}), flush=True)


if __name__ == "__main__":
    pretrain_moe.main(sys.argv[1:])
    print_children()
