"""What one decoder layer of a recipe's model keeps for its backward, per micro-batch, measured,
against the dry run's figure (moe_launcher/activation_memory.py).

    python bench/layer_activations.py RECIPE [RECIPE ...] [--experts 16]

Builds the first MoE layer of the recipe's MODEL_ARGS (and the layers before it) with megatron
on this machine (local spec, bf16, world size 1, `--experts` routed experts in place of the
model's: a token's activations depend on its top-k, not on how many experts there are) and runs
its forward under torch's saved-tensor hooks, which see every tensor autograd keeps for the
backward; the weights and the attention mask (the batch's, shared by every layer) are not
counted. Prints, at two sequence lengths, the dry run's figure for megatron's local spec over
the bytes measured (the reference), then the dry run's figure on the GPU path (Transformer
Engine's kernels: no s x s scores, bf16 norm inputs) for the recipe's own experts at its
--seq-length. A reference on CPU, not a GPU measurement.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
LENGTHS = (256, 512)
# the GPU recipes' precision and dispatch (_gpu_common.sh's IMPL_ARGS, less TE's kernels) and
# their dropout (its TRAIN_ARGS')
IMPL_FLAGS = ["--bf16", "--moe-router-dtype", "fp32", "--moe-token-dispatcher-type", "alltoall",
              "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]


def model_args(recipe: str) -> list[str]:
    """The recipe's MODEL_ARGS and its vocabulary, as its model file sets them."""
    out = subprocess.run(["bash", "-c", 'RECIPE_DIR=$1; source "$1/$2.sh" >/dev/null; '
                          'printf "%s\\0" "${MODEL_ARGS[@]}" --vocab-size "$VOCAB_SIZE"', "_",
                          os.path.join(ROOT, "examples", "moe", "recipes"), recipe],
                         capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


def _with(flags: list[str], flag: str, value: str) -> list[str]:
    """`flags` with `flag` set to `value` (megatron's parser takes the last one)."""
    return [*flags, flag, value]


def saved_bytes(flags: list[str], layer: int, seq_length: int) -> tuple[int, float]:
    """(bytes autograd keeps for the backward of one forward of decoder layer `layer`, the dry
    run's figure for it on the local spec)."""
    import torch

    import _megatron_cpu as cpu
    from moe_launcher import activation_memory
    from moe_launcher.convert import megatron_side

    args, config = megatron_side.args_of_flags(flags, seq_length)
    with torch.device("cpu"):
        model = megatron_side.build(config)
    block = model.decoder.layers[layer]
    rotary = None if args.multi_latent_attention else model.rotary_pos_emb(seq_length)
    measured = cpu.kept_for_backward(model, lambda hidden, mask: block(
        hidden, attention_mask=mask, rotary_pos_emb=rotary), seq_length)
    return measured, activation_memory.layer_bytes(args, True, "local")


def one_layer_flags(flags: list[str], layer: int, experts: int) -> list[str]:
    """The recipe's model up to MoE layer `layer`, with `experts` routed experts and no MTP."""
    if "--mtp-num-layers" in flags:
        at = flags.index("--mtp-num-layers")
        flags = flags[:at] + flags[at + 2:]
    small = _with(flags, "--num-layers", str(layer + 1))
    if layer:
        small = _with(small, "--moe-layer-freq", f"([0]*{layer}+[1])")
    small = _with(small, "--num-experts", str(experts))
    small += IMPL_FLAGS
    if "--moe-router-num-groups" in flags:  # (the groups must split the fewer experts)
        small = _with(_with(small, "--moe-router-num-groups", "1"), "--moe-router-group-topk",
                      "1")
    return small


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--experts", type=int, default=16)
    options = parser.parse_args()
    from moe_launcher import activation_memory
    from moe_launcher.convert import megatron_side
    from moe_launcher.preflight import moe_pattern

    megatron_side.start()
    for recipe in options.recipes:
        flags = model_args(recipe)
        seq_length = int(flags[flags.index("--seq-length") + 1])
        args, _ = megatron_side.args_of_flags([*flags, *IMPL_FLAGS], seq_length)
        layer = moe_pattern(args).index(1)
        small = one_layer_flags(flags, layer, options.experts)
        ratios = []
        for length in LENGTHS:
            measured, planned = saved_bytes(small, layer, length)
            ratios.append(f"{planned / measured:.4f} at {length} tokens")
        # (this machine's platform defaults turn RoPE fusion off; a GPU keeps megatron's
        # default unless the recipe turns it off)
        args.apply_rope_fusion = "--no-rope-fusion" not in flags
        on_gpu = activation_memory.layer_bytes(args, True, "te")
        print(f"layer_activations: {recipe} MoE layer {layer}: dry run / measured (local spec, "
              f"{options.experts} experts) {', '.join(ratios)}; the dry run on the GPU path: "
              f"{on_gpu / 2**30:.2f} GiB a micro-batch at {seq_length} tokens "
              f"({on_gpu / seq_length / 2**10:.0f} KiB a token)", flush=True)


if __name__ == "__main__":
    main()
