"""Time and peak memory of the converter's commands on a random Qwen3-MoE (no downloads).

    python bench/convert_bench.py [--layers 4] [--hidden 512] [--experts 16]

Makes the model with transformers' config class (bf16, sharded safetensors) and runs the real
command lines one after the other: import-hf, export-hf of that torch_dist checkpoint,
to-fsdp-dtensor, export-hf of the fsdp_dtensor one, to-torch-dist of it and export-hf of that.
For each: wall time, throughput (model bytes per second) and peak resident memory over a tiny
model's run of the same command (the process's own cost), as a multiple of the model's bytes
and of its largest tensor. Every command streams: a parameter is read when it is written, each
(safetensors or DCP) tensor written as it comes (goal <= 2x the largest tensor). Last, the three
exports are compared with the source folder, tensor by tensor (bit-identical, or the bench
fails).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(folder: str, layers: int, hidden: int, experts: int) -> tuple[int, int]:
    """Saves the model, in a process of its own; returns its bytes and its largest tensor's.
    (Made in this process it would stay resident here, and a child's peak RSS, which Linux
    counts from the fork, would include it.)"""
    done = subprocess.run([sys.executable, __file__, "--make", folder, str(layers), str(hidden),
                           str(experts)], cwd=ROOT, capture_output=True, text=True, check=True)
    size, largest = map(int, done.stdout.split()[-2:])
    return size, largest


def _make_model(folder: str, layers: int, hidden: int, experts: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
                            moe_intermediate_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                            num_experts=experts, num_experts_per_tok=4,
                            max_position_embeddings=4096, dtype="bfloat16")
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="200MB")
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    print(sum(sizes), max(sizes))


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


def bench(layers: int, hidden: int, experts: int) -> tuple[int, int, dict]:
    """The model's bytes, its largest tensor's, and each command's (seconds, peak RSS bytes)."""
    with tempfile.TemporaryDirectory(prefix="convert_bench_") as root:
        hf, ckpt, out, fsdp, out2, back, out3 = (
            os.path.join(root, name) for name in ("hf", "ckpt", "out", "fsdp", "out2", "back",
                                                  "out3"))
        size, largest = make_model(hf, layers, hidden, experts)
        runs = {"import-hf": timed("import-hf", hf, ckpt),
                "export-hf (torch_dist)": timed("export-hf", ckpt, out),
                "to-fsdp-dtensor": timed("to-fsdp-dtensor", ckpt, fsdp),
                "export-hf (fsdp_dtensor)": timed("export-hf", fsdp, out2),
                "to-torch-dist": timed("to-torch-dist", fsdp, back),
                "export-hf (to-torch-dist's)": timed("export-hf", back, out3)}
        compared = [same_tensors(hf, exported) for exported in (out, out2, out3)]
        return size, largest, runs, compared[0]


def same_tensors(source: str, exported: str) -> int:
    """How many tensors `exported` holds, once each is checked to equal the source folder's
    bit for bit (one tensor of each in memory at a time)."""
    import torch
    from safetensors import safe_open

    def tensors(folder: str) -> dict[str, str]:
        index = os.path.join(folder, "model.safetensors.index.json")
        if not os.path.exists(index):  # one file
            with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
                return {name: "model.safetensors" for name in f.keys()}
        with open(index) as f:
            return json.load(f)["weight_map"]

    have, want = tensors(exported), tensors(source)
    if sorted(have) != sorted(want):
        raise SystemExit(f"{exported} holds other tensors than {source}")
    for name in want:
        with safe_open(os.path.join(source, want[name]), "pt") as a, \
                safe_open(os.path.join(exported, have[name]), "pt") as b:
            if not torch.equal(a.get_tensor(name), b.get_tensor(name)):
                raise SystemExit(f"{exported}: {name} differs from {source}'s")
    return len(want)


def main() -> None:
    if sys.argv[1:2] == ["--make"]:
        folder, *sizes = sys.argv[2:]
        _make_model(folder, *map(int, sizes))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    options = parser.parse_args()
    _, _, fixed, _ = bench(1, 64, 4)  # the process's own cost: megatron, transformers, torch
    size, largest, runs, compared = bench(options.layers, options.hidden, options.experts)
    print(f"model: {size / 1e6:.1f} MB of bf16 weights, largest tensor {largest / 1e6:.1f} MB")
    for command, (seconds, peak) in runs.items():
        extra = peak - fixed[command][1]
        print(f"{command}: {seconds:.1f} s ({size / 1e9 / seconds * 60:.2f} GB/min); peak RSS "
              f"{peak / 1e6:.0f} MB, {extra / 1e6:.0f} MB over a tiny model's = "
              f"{extra / size:.2f}x the model, {extra / largest:.2f}x its largest tensor")
    print(f"the three exports and the source folder: bit-identical ({compared} tensors)")

if __name__ == "__main__":
    main()
