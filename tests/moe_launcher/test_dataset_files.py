"""A --data-path whose .idx or .bin is damaged is refused before work (issue 46 item 1), judged by
the launcher's checks in-process (tests/_judge.py) on data written by megatron's own
IndexedDatasetBuilder. Before, a .bin cut to half was a traceback in a DataLoader worker on every
rank; cut less, the run trained until its samples reached the cut; a short .idx was a traceback."""

from __future__ import annotations

import os
import re

import numpy
import pytest
import torch

from _judge import judge
from _launch import TINY_MODEL

MODEL = [arg for arg in TINY_MODEL if arg != "--mock-data"] + ["--train-iters", "2"]


def written(prefix: str, ids_below: int = 500) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for _ in range(32):
        builder.add_item(torch.from_numpy(rng.integers(1, ids_below, int(rng.integers(20, 200)))))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def cut(path: str, keep) -> None:
    os.truncate(path, keep(os.path.getsize(path)))


@pytest.mark.parametrize("damage, named", [
    (lambda p: cut(p + ".bin", lambda n: n // 2), "the .bin is truncated"),
    (lambda p: cut(p + ".bin", lambda n: n - 2), "the .bin is truncated"),  # one token short
    (lambda p: cut(p + ".idx", lambda n: n - 100), "it is truncated"),
    (lambda p: open(p + ".idx", "r+b").write(b"NOTANIDX"), "no MMIDIDX header"),
], ids=["bin-half", "bin-one-token-short", "idx-100-bytes-short", "idx-not-an-index"])
def test_a_damaged_dataset_is_refused_naming_the_file(damage, named, tmp_path, monkeypatch):
    prefix = str(tmp_path / "corpus_text_document")
    written(prefix)
    damage(prefix)
    line = judge(1, [*MODEL, "--data-path", "0.7", prefix, "0.3", prefix], monkeypatch)
    assert line and line.startswith("pretrain_moe: error: --data-path ") and "\n" not in line, line
    assert named in line and prefix in line and "fix:" in line, line


def test_an_intact_dataset_passes(tmp_path, monkeypatch):
    prefix = str(tmp_path / "corpus_text_document")
    written(prefix)
    assert judge(1, [*MODEL, "--data-path", prefix], monkeypatch) is None


def test_datasets_named_in_files_are_checked_too(tmp_path, monkeypatch):
    """--data-args-path and --per-split-data-args-path name their datasets in a file, which
    megatron reads (get_blend_and_blend_per_split): the datasets they name are judged the same,
    the refusal naming the flag; a listing file that does not exist is refused in one line."""
    import json

    good, damaged = str(tmp_path / "good_text_document"), str(tmp_path / "cut_text_document")
    written(good)
    written(damaged)
    cut(damaged + ".bin", lambda n: n // 2)
    listing = tmp_path / "data_args.txt"
    listing.write_text(f"0.5 {good} 0.5 {damaged}\n")
    line = judge(1, [*MODEL, "--data-args-path", str(listing)], monkeypatch)
    assert line and line.startswith(f"pretrain_moe: error: --data-args-path {damaged}: "), line
    assert "the .bin is truncated" in line, line

    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": [good], "valid": [damaged], "test": [good]}))
    line = judge(1, [*MODEL, "--per-split-data-args-path", str(splits)], monkeypatch)
    assert line and line.startswith(f"pretrain_moe: error: --per-split-data-args-path {damaged}: "), line

    splits.write_text(json.dumps({"train": [good], "valid": [good], "test": [good]}))
    assert judge(1, [*MODEL, "--per-split-data-args-path", str(splits)], monkeypatch) is None
    line = judge(1, [*MODEL, "--data-args-path", str(tmp_path / "absent.txt")], monkeypatch)
    assert line and "--data-args-path" in line and "no such file" in line, line


def test_token_ids_past_the_vocabulary_stop_the_run_in_one_line(tmp_path):
    """Data tokenized with a larger tokenizer than the model's (ids up to 499 for a 64-token
    NullTokenizer, 128 embedding rows once padded): before, an IndexError in the embedding on
    every rank (a device-side assert on a GPU); now the rank that reads the batch names the data,
    the id and the iteration in one line, before the batch moves to the device."""
    from _launch import launch

    prefix = str(tmp_path / "corpus_text_document")
    written(prefix)
    model = [arg for arg in MODEL if arg not in ("--vocab-size", "512")]
    run = launch(1, [*model, "--vocab-size", "64", "--data-path", prefix, "--split", "100,0,0"])
    errors = [line for line in run.log.splitlines() if "pretrain_moe: error:" in line]
    assert run.exit_codes == [1] and len(errors) == 1, run.log[-3000:]
    assert f"--data-path: token id " in errors[0] and "past the model's vocabulary (128 " \
        "embedding rows" in errors[0] and "iteration 1 " in errors[0], errors[0]
    # the row's dataset and its sample index there (moe_launcher.data.SamplesNamed)
    assert re.search(rf"token id \d+ \(sample \d+ of {re.escape(prefix)}\) in the micro-batch",
                     errors[0]), errors[0]
    assert "Traceback" not in run.log and "IndexError" not in run.log
    assert "iteration        1/" not in run.log

    # In a blend, the row's own dataset is named, not the blend's other one.
    fits = str(tmp_path / "fits_text_document")
    written(fits, ids_below=64)
    run = launch(1, [*model, "--vocab-size", "64", "--data-path", "0.5", fits, "0.5", prefix,
                     "--split", "100,0,0"])
    errors = [line for line in run.log.splitlines() if "pretrain_moe: error:" in line]
    assert run.exit_codes == [1] and len(errors) == 1, run.log[-3000:]
    assert re.search(rf"\(sample \d+ of {re.escape(prefix)}\)", errors[0]), errors[0]

