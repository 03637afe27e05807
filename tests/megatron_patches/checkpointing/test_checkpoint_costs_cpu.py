"""What the checkpoint checks cost in filesystem operations and collectives, counted per rank in
a real 2-rank save and load (tests/_io_count_launch.py hooks the module attributes the patches
call):

* the commit: each rank fsyncs only the files it wrote, found by name; rank 0 adds only the
  unowned ones, and only rank 0 lists the staging directory;
* the save guard checks a structure once: a second save of the same structure runs no model
  check and no tiling check, with or without --ckpt-assume-constant-structure (and with it no
  second all-rank metadata gather);
* the load: one rank checks the files, and every rank reads `.metadata` from disk once, for the
  checks and megatron's own load together (megatron alone reads it twice).
"""

import json
import re

import pytest
from _launch import REPO, TINY_MODEL, launch

pytestmark = pytest.mark.slow

COUNTING = REPO / "tests" / "_io_count_launch.py"


def counted_run(counts, args, disable=""):
    counts.mkdir(exist_ok=True)
    launch(2, [*TINY_MODEL, *args], env={"IO_COUNT_DIR": str(counts),
                                         "MEGATRON_PATCHES_DISABLE": disable},
           timeout=400, script=COUNTING).check()
    return [json.loads((counts / f"rank{r}.json").read_text()) for r in range(2)]


def test_checkpoint_io_per_rank_in_a_real_save_and_load(tmp_path):
    save = tmp_path / "ckpt"
    two_saves = ["--train-iters", "3", "--exit-interval", "2", "--save-interval", "1"]
    saving = counted_run(tmp_path / "save", [*two_saves, "--save", str(save),
                                             "--ckpt-assume-constant-structure"])
    for rank, counts in enumerate(saving):
        rank_files = [n for n in counts["fsynced"] if re.search(r"__\d+_\d+\.distcp$", n)]
        assert rank_files and all(f"__{rank}_" in n for n in rank_files), counts["fsynced"]
        # megatron checked the first save; the second reuses the guard's verdict.
        assert counts["gathers"] == 0 and counts["model_checks"] == 1, counts
    # Only rank 0 lists the staging directory (its walk for the unowned files, and megatron's)
    assert saving[1]["staging_lists"] == 0 < saving[0]["staging_lists"], saving
    unowned = [n for n in saving[0]["fsynced"] if not n.endswith(".distcp")]
    assert ".metadata" in unowned and not [n for n in saving[1]["fsynced"]
                                           if not n.endswith(".distcp")]
    # Without the flag megatron gathers and checks at both saves; the guard still checks once.
    revalidated = counted_run(tmp_path / "save2", [*two_saves, "--save", str(tmp_path / "c2")])
    assert [c["model_checks"] for c in revalidated] == [1, 1], revalidated
    assert ([c["tiling_checks"] for c in revalidated] == [c["tiling_checks"] for c in saving]
            and saving[0]["tiling_checks"] >= 1), (saving, revalidated)

    loading = counted_run(tmp_path / "load", ["--train-iters", "3", "--load", str(save)])
    assert [c["file_checks"] for c in loading] == [1, 0], loading
    assert [c["metadata_reads"] for c in loading] == [1, 1], loading
    # megatron's load alone (both load checks disabled) reads it more often on every rank.
    plain = counted_run(tmp_path / "plain", ["--train-iters", "3", "--load", str(save)],
                        disable="checkpoint-load-guard,checkpoint-load-integrity")
    assert all(c["metadata_reads"] > 1 for c in plain), plain
