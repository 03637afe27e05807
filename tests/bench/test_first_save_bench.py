"""bench/first_save_bench.py runs one pair (2 ranks forked from the suite's rank server, in this
process): a line per run with both saves and what the ranks left running, and the last line the
bench promises."""

import re
import sys

import pytest

from _launch import REPO

sys.path.insert(0, str(REPO / "bench"))
import first_save_bench  # noqa: E402

LAST = re.compile(r"^first save patched/unpatched: [\d.]+ \((\d+) / (\d+) ms\); second save: "
                  r"[\d.]+; resident per rank in processes megatron's saves left: (\d+) / "
                  r"(\d+) MB$")


@pytest.mark.slow
def test_first_save_bench_runs_one_pair(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["first_save_bench.py", "--pairs", "1", "--nproc", "2",
                                      "--rank-server"])
    first_save_bench.main()
    lines = capsys.readouterr().out.splitlines()
    runs = [line for line in lines if re.match(r"(patched|unpatched) +first save", line)]
    assert len(runs) == 2 and "left running per rank: [] 0 MB" in next(
        line for line in runs if line.startswith("patched")), lines
    assert "['SyncManager" in next(line for line in runs if line.startswith("unpatched")), lines
    last = LAST.match(lines[-1])
    assert last and last[3] == "0" and int(last[4]) > 0, lines[-1]
