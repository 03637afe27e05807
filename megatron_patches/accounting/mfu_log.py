"""Model FLOPs utilisation next to megatron's TFLOP/s/GPU.

MFU = achieved TFLOP/s per GPU (megatron's throughput, now from flops_from_layer_census.py) / the device's dense
bf16 peak. megatron's training_log builds its iteration line as a string and prints it with
print_rank_last; wrapping that one call (as training.py sees it) is the least invasive hook:
the line already carries the throughput, and tensorboard/wandb get MFU the way they get
'throughput'. On CPU or an unknown device there is no peak to divide by: said once, no MFU.

megatron prints the throughput with one decimal, so a CPU run shows 0.0 TFLOP/s/GPU. Below 10
the line gets at least three significant digits, from the exact value megatron hands
one_logger_utils.track_e2e_metrics just before it builds the line (GPU lines, above 10, keep
megatron's format); MFU is computed from that value too.
"""

from __future__ import annotations

import functools
import math
import re

import torch

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "mfu-log"

# Dense bf16 peak TFLOP/s by torch.cuda.get_device_name() substring; first match wins, so the
# more specific names come first ("GH200" contains "H200", "H100 PCIe" contains "H100").
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
)

_THROUGHPUT = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+) \|")
_ITERATION = re.compile(r" iteration\s+(\d+)/")


def peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    for name, peak in PEAK_BF16_TFLOPS:
        if name in device_name:
            return peak
    return None


def device_name() -> str | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def mfu(tflops_per_gpu: float, peak: float) -> float:
    return tflops_per_gpu / peak


def with_mfu(log_line: str, peak: float | None) -> tuple[str, float | None]:
    """The iteration line with ' MFU: x% |' after the throughput, and the MFU (None if none)."""
    found = _THROUGHPUT.search(log_line)
    if found is None or peak is None:
        return log_line, None
    value = mfu(float(found.group(1)), peak)
    return log_line[:found.end()] + f" MFU: {100 * value:.1f}% |" + log_line[found.end():], value


def precise_throughput(value: float) -> str:
    """megatron's one decimal from 10 TFLOP/s up, else at least three significant digits."""
    if not value > 0 or value >= 10 or math.isinf(value):
        return f"{value:.1f}"
    return f"{value:.{2 - math.floor(math.log10(value))}f}"


def with_precise_throughput(log_line: str, throughput: float | None) -> str:
    """The line with `throughput` in its TFLOP/s/GPU field, where the field is megatron's
    one-decimal print of that same value."""
    found = _THROUGHPUT.search(log_line)
    if found is None or throughput is None or found.group(1) != f"{throughput:.1f}":
        return log_line
    return (log_line[:found.start(1)] + precise_throughput(throughput)
            + log_line[found.end(1):])


def _say_once(message: str, say, said: set[str]) -> None:
    if message not in said:
        said.add(message)
        say(message)


def _log_to_writers(value: float, iteration: int) -> None:
    from megatron.training import get_args
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    if not get_args().log_timers_to_tensorboard:
        return  # megatron writes 'throughput' only then; MFU follows it
    if (writer := get_tensorboard_writer()) is not None:
        writer.add_scalar("mfu", value, iteration)
    if (wandb_writer := get_wandb_writer()) is not None:
        wandb_writer.log({"mfu": value}, iteration)


def _apply() -> None:
    from megatron.training import training
    if wrapped_by(training.print_rank_last, NAME):
        return
    megatron_print = training.print_rank_last
    said: set[str] = set()  # notes this wrapper printed once
    measured: dict[str, float] = {}  # the exact throughput of the line being built
    track = training.one_logger_utils.track_e2e_metrics

    @functools.wraps(track)
    def track_e2e_metrics(log_throughput=False, throughput=None):
        if throughput is not None:
            measured["throughput"] = throughput
        return track(log_throughput, throughput)

    track_e2e_metrics.__wrapped_by__ = NAME
    training.one_logger_utils.track_e2e_metrics = track_e2e_metrics

    @functools.wraps(megatron_print)
    def print_rank_last(message):
        if isinstance(message, str) and _THROUGHPUT.search(message):
            message = with_precise_throughput(message, measured.pop("throughput", None))
            name = device_name()
            peak = peak_tflops(name)
            if peak is None:
                _say_once(f"[megatron_patches] MFU: not reported, no dense bf16 peak known for "
                          f"device {name or 'cpu'!r}", megatron_print, said)
            message, value = with_mfu(message, peak)
            iteration = _ITERATION.search(message)
            if value is not None and iteration is not None:
                _log_to_writers(value, int(iteration.group(1)))
        return megatron_print(message)

    print_rank_last.__wrapped_by__ = NAME
    training.print_rank_last = print_rank_last


def _not_needed(context: PatchContext) -> str | None:
    import inspect

    from megatron.training.training import training_log
    if "MFU" in inspect.getsource(training_log):
        return "megatron-core logs MFU itself"
    return None


register(Patch(
    name=NAME,
    upstream="local",
    versions=">=0.15,<0.20",
    packages=("megatron.training",),
    summary="appends MFU (TFLOP/s/GPU over the device's dense bf16 peak) to the iteration log "
            "via megatron.training.training.print_rank_last, and to tensorboard/wandb; prints "
            "a throughput below 10 TFLOP/s/GPU with three significant digits, not 0.0",
    not_needed_because=_not_needed,
    apply=_apply,
))
