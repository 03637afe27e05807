"""One rank of test_context_parallel_batch (CPU, gloo); run under torchrun with 4 ranks.

Initialises megatron's process groups as DP2 x CP2 and passes one batch through the forward
step's batch reader (moe_launcher.gpt_step._next_batch). Each rank checks that it keeps exactly
the two sequence chunks megatron's load-balanced CP split gives its CP rank: chunks r and
2 x CP - 1 - r of 2 x CP, in every sequence-dimension field. Prints one line per rank.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_launcher import cpu_backend  # noqa: E402

cpu_backend.activate()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.training.global_vars import set_args  # noqa: E402

from moe_launcher import gpt_step  # noqa: E402

CP, SEQ = 2, 16
VOCAB = 4096  # above every id in the batch: the step's vocabulary check passes it


def main() -> None:
    dist.init_process_group("gloo")
    # The step reads the model's vocabulary from megatron's arguments, as under pretrain().
    set_args(SimpleNamespace(padded_vocab_size=VOCAB))
    parallel_state.initialize_model_parallel(context_parallel_size=CP)
    cp_rank = parallel_state.get_context_parallel_rank()
    positions = torch.arange(SEQ).repeat(2, 1)  # micro-batch of 2 sequences
    batch = {"tokens": positions + 1000, "labels": positions + 2000,
             "loss_mask": (positions % 3).float(), "position_ids": positions.clone(),
             "attention_mask": None}
    sliced = gpt_step._next_batch(iter([batch]))

    chunk = SEQ // (2 * CP)
    kept = torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * CP - 1 - cp_rank) * chunk, (2 * CP - cp_rank) * chunk)])
    expected = {"tokens": kept + 1000, "labels": kept + 2000, "loss_mask": (kept % 3).float(),
                "position_ids": kept}
    wrong = [key for key, value in expected.items()
             if not torch.equal(sliced[key], value.repeat(2, 1))]
    assert sliced["attention_mask"] is None
    verdict = (f"rank {dist.get_rank()} cp_rank {cp_rank}: "
               + (f"wrong slice of {wrong}: positions {sliced['position_ids'][0].tolist()}"
                  if wrong else "slice ok"))
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, verdict)  # one printer: ranks' lines would interleave
    if dist.get_rank() == 0:
        print("\n".join(verdicts), flush=True)


if __name__ == "__main__":
    main()
