"""What the checkpoint checks cost in filesystem operations and collectives, counted per rank in
a real 2-rank save and load (tests/_io_count_launch.py hooks the module attributes the patches
call):

* the commit: each rank fsyncs only the files it wrote; rank 0 adds only the unowned ones;
* --ckpt-assume-constant-structure: the save guard checks the first save's structure and
  reuses the verdict at the next save (no second all-rank metadata gather, no model walk);
* the load: one rank checks the files; every rank reads `.metadata` once for the layout guard.
"""

import json
import re

import pytest
from _launch import REPO, TINY_MODEL, launch

pytestmark = pytest.mark.slow

COUNTING = REPO / "tests" / "_io_count_launch.py"


def counted_run(counts, args):
    counts.mkdir(exist_ok=True)
    launch(2, [*TINY_MODEL, *args], env={"IO_COUNT_DIR": str(counts)}, timeout=400,
           script=COUNTING).check()
    return [json.loads((counts / f"rank{r}.json").read_text()) for r in range(2)]


def test_checkpoint_io_per_rank_in_a_real_save_and_load(tmp_path):
    save = tmp_path / "ckpt"
    saving = counted_run(tmp_path / "save", [
        "--train-iters", "3", "--exit-interval", "2", "--save-interval", "1", "--save", str(save),
        "--ckpt-assume-constant-structure"])
    for rank, counts in enumerate(saving):
        rank_files = [n for n in counts["fsynced"] if re.search(r"__\d+_\d+\.distcp$", n)]
        assert rank_files and all(f"__{rank}_" in n for n in rank_files), counts["fsynced"]
        # megatron checked the first save; the second reuses the guard's verdict.
        assert counts["gathers"] == 0 and counts["model_checks"] == 1, counts
    unowned = [n for n in saving[0]["fsynced"] if not n.endswith(".distcp")]
    assert ".metadata" in unowned and not [n for n in saving[1]["fsynced"]
                                           if not n.endswith(".distcp")]

    loading = counted_run(tmp_path / "load", [
        "--train-iters", "3", "--load", str(save)])
    assert [c["file_checks"] for c in loading] == [1, 0], loading
    assert [c["metadata_reads"] for c in loading] == [1, 1], loading
