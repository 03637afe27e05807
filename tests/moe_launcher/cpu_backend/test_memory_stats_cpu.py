"""The CPU backend's torch.cuda.memory_stats has the caching allocator's keys (all 0, as
memory_allocated() is here): megatron's --log-memory-to-tensorboard reads them by name in
training_log, which failed on the last rank with a KeyError (an empty dict) and stopped the run.
The reference for the keys is megatron's own code: every `mem_stats["..."]` it reads."""

import inspect
import re

import torch

from _launch import TINY_MODEL, launch, tensorboard_scalars


def test_memory_stats_has_every_key_megatron_reads():
    from megatron.training import training

    read = set(re.findall(r'mem_stats\["([^"]+)"\]', inspect.getsource(training.training_log)))
    assert read, "megatron's training_log reads no memory_stats key any more"
    stats = torch.cuda.memory_stats()
    assert read <= stats.keys(), read - stats.keys()
    assert set(stats.values()) == {0}


def test_memory_is_logged_to_tensorboard(tmp_path):
    run = launch(1, [*TINY_MODEL, "--train-iters", "1", "--tensorboard-dir", str(tmp_path),
                     "--log-memory-to-tensorboard"], timeout=300)
    assert run.returncode == 0, run.log[-3000:]
    assert tensorboard_scalars(tmp_path, "mem-reserved-bytes") == {1: 0.0}
