"""The forward step's check of a host batch for token ids past the model's vocabulary
(moe_launcher.gpt_step._refuse_ids_past_vocabulary), against the host work megatron's data path
already does for every micro-batch: torch's default_collate of the GPTDataset samples into that
batch (tokens, labels, loss mask, position ids, as megatron's DataLoader builds it), measured in
the same run, at micro-batch shapes of GPU training.

    python bench/batch_check_bench.py [--shapes 1x4096,4x8192,16x8192]
"""

from __future__ import annotations

import argparse
import os
import sys
import types

import torch
from torch.utils.data import default_collate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.timing import median_seconds  # noqa: E402

from megatron.training.global_vars import set_args  # noqa: E402

from moe_launcher import gpt_step  # noqa: E402

VOCAB = 151_936  # Qwen3's padded vocabulary: ids drawn below it, so the check passes


def sample(seq: int, generator: torch.Generator) -> dict:
    """One GPTDataset sample as megatron's dataset returns it (no attention mask: fused
    attention builds its own)."""
    text = torch.randint(0, VOCAB, (seq + 1,), generator=generator)
    return {"tokens": text[:-1].contiguous(), "labels": text[1:].contiguous(),
            "loss_mask": torch.ones(seq), "position_ids": torch.arange(seq)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x4096,4x8192,16x8192",
                        help="micro-batch size x sequence length")
    parser.add_argument("--repeats", type=int, default=51)
    options = parser.parse_args()
    # The check reads the model's vocabulary from megatron's arguments, as under pretrain().
    set_args(types.SimpleNamespace(padded_vocab_size=VOCAB))
    generator = torch.Generator().manual_seed(0)
    for shape in options.shapes.split(","):
        micro_batch, seq = map(int, shape.split("x"))
        samples = [sample(seq, generator) for _ in range(micro_batch)]
        batch = default_collate(samples)
        check = median_seconds(options.repeats,
                               lambda: gpt_step._refuse_ids_past_vocabulary(batch))
        collate = median_seconds(options.repeats, lambda: default_collate(samples))
        print(f"micro-batch {micro_batch:3d} x {seq:5d} tokens: check {check * 1e6:8.1f} us | "
              f"default_collate of the same batch {collate * 1e6:8.1f} us | check / collate "
              f"{check / collate:.3f}", flush=True)


if __name__ == "__main__":
    main()
