"""Time and peak memory of import-hf and export-hf on a random Qwen3-MoE (no downloads).

    python bench/convert_bench.py [--layers 4] [--hidden 512] [--experts 16]

Makes the model with transformers' config class (bf16, sharded safetensors), runs the real
command lines one after the other, and prints each one's wall time, throughput (model bytes per
second) and peak resident memory over a tiny model's run (the process's own cost) as a multiple
of the model's bytes. megatron builds in fp32 and the converter then casts to the checkpoint's
dtype, so a bf16 model costs 1.5-2x its bytes now; building in the weights' dtype would make
it about 1x.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(folder: str, layers: int, hidden: int, experts: int) -> int:
    """Saves the model; returns its bytes."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
                            moe_intermediate_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                            num_experts=experts, num_experts_per_tok=4,
                            max_position_embeddings=4096, dtype="bfloat16")
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="200MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def timed(*argv: str) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one conversion in a process of its own."""
    start = time.monotonic()
    pid = subprocess.Popen([sys.executable, "-m", "moe_launcher.convert", *argv], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL).pid
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"convert {argv[0]} failed; rerun it by hand: {' '.join(argv)}")
    return time.monotonic() - start, usage.ru_maxrss * 1024  # Linux reports KiB


def bench(layers: int, hidden: int, experts: int) -> tuple[int, dict[str, tuple[float, int]]]:
    """The model's bytes, and each command's (seconds, peak RSS bytes)."""
    with tempfile.TemporaryDirectory(prefix="convert_bench_") as root:
        hf, ckpt, out = (os.path.join(root, name) for name in ("hf", "ckpt", "out"))
        size = make_model(hf, layers, hidden, experts)
        return size, {"import-hf": timed("import-hf", hf, ckpt),
                      "export-hf": timed("export-hf", ckpt, out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    options = parser.parse_args()
    _, fixed = bench(1, 64, 4)  # the process's own cost: megatron, transformers, torch
    size, runs = bench(options.layers, options.hidden, options.experts)
    for command, (seconds, peak) in runs.items():
        extra = peak - fixed[command][1]
        print(f"{command}: {size / 1e6:.1f} MB in {seconds:.1f} s ({size / 1e6 / seconds:.1f} "
              f"MB/s); peak RSS {peak / 1e6:.0f} MB, {extra / 1e6:.0f} MB over a tiny model's "
              f"= {extra / size:.2f}x the model")

if __name__ == "__main__":
    main()
