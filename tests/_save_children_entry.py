"""pretrain_moe.py that prints, on every rank once training (and its saves) is done, the child
processes this rank has left running, by multiprocessing's names, as one JSON object:
`save-children {"rank": <r>, "children": [<names>]}` (run by test_sync_save_cpu.py; the ranks
share one pipe, so a rank's object may land inside another's line)."""

import json
import multiprocessing
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pretrain_moe  # noqa: E402

if __name__ == "__main__":
    pretrain_moe.main(sys.argv[1:])
    names = sorted(process.name for process in multiprocessing.active_children())
    print("save-children " + json.dumps({"rank": int(os.environ["RANK"]), "children": names}),
          flush=True)
