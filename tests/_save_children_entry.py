"""pretrain_moe.py that prints, on every rank once training (and its saves) is done, the child
processes this rank has left running, by multiprocessing's names:
`rank <r>: child processes after training: <names, or none>` (run by
test_sync_save_cpu.py)."""

import multiprocessing
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pretrain_moe  # noqa: E402

if __name__ == "__main__":
    pretrain_moe.main(sys.argv[1:])
    names = sorted(process.name for process in multiprocessing.active_children())
    print(f"rank {os.environ['RANK']}: child processes after training: "
          f"{', '.join(names) or 'none'}", flush=True)
