"""megatron's argument dump goes to $MEGATRON_ARGUMENTS_FILE, the rest of its output stays: the
block is megatron's own, printed by megatron's own _print_args (megatron-core's format is the
reference), and the file is written only when asked."""

import argparse

from moe_launcher.argument_dump import (
    ARGUMENTS_FILE_ENV, argument_block_kept, write_argument_block)


def megatron_output():
    from megatron.training.arguments import _print_args

    print("using world size: 4, data-parallel size: 4")
    _print_args("arguments", argparse.Namespace(num_layers=4, hidden_size=128, seq_length=None))
    print("setting number of microbatches to constant 2")


def test_the_block_goes_to_the_file_and_the_rest_is_printed(tmp_path, capsys):
    path = tmp_path / "run" / "megatron_arguments.txt"
    environ = {ARGUMENTS_FILE_ENV: str(path)}
    with argument_block_kept(environ) as block:
        megatron_output()
    assert capsys.readouterr().out == ("using world size: 4, data-parallel size: 4\n"
                                       "setting number of microbatches to constant 2\n")
    assert not path.exists()  # written once every check has passed, by the caller
    line = write_argument_block(block, environ)
    assert line == f"[pretrain_moe] megatron's arguments (3 flags): {path}"
    lines = path.read_text().splitlines()
    assert "-- arguments --" in lines[0] and "end of arguments" in lines[-1]
    assert [line.split()[0] for line in lines[1:-1]] == ["hidden_size", "num_layers",
                                                         "seq_length"]
    assert [line.split()[-1] for line in lines[1:-1]] == ["128", "4", "None"]


def test_without_the_variable_megatron_prints_it_and_nothing_is_written(tmp_path, capsys):
    with argument_block_kept({}) as block:
        megatron_output()
    out = capsys.readouterr().out
    assert "-- arguments --" in out and "num_layers" in out and "end of arguments" in out
    assert block == [] and write_argument_block(block, {}) is None
    assert list(tmp_path.iterdir()) == []
