"""Pretrain a Mixture-of-Experts GPT with megatron-core's own pretrain(), plus this project's fixes.

    torchrun --nproc-per-node=N pretrain_moe.py <Megatron-LM flags>

Every Megatron-LM flag passes through unchanged. On machines without CUDA the CPU backend is
activated and the CPU-only flags are supplied, so the command line is the same everywhere.
"""

import atexit
import faulthandler
import os
import signal
import sys

import torch

from moe_launcher.preflight import check_environment, check_gpu_request
from moe_launcher.runtime.refusals import (
    EXIT_STATUS as PREFLIGHT_EXIT, PreflightError, find_refusal, refusal_line)


def log0(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


def main(argv: list[str]) -> None:
    # A rank killed by a signal (SIGABRT from NCCL's watchdog after a collective timed out or
    # from glibc on a corrupted heap, SIGSEGV) prints every thread's Python stack first: the log
    # says where each rank was, not only that one died.
    faulthandler.enable(all_threads=True)
    # A write past the file-size limit (RLIMIT_FSIZE) raises OSError(EFBIG) instead of killing
    # the process, so a save that runs out of room fails like a full disk, with a message.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    track = check_environment()
    # Before the first CUDA call (torch.cuda.is_available() starts CUDA): see the function.
    from moe_launcher.platform_defaults import (
        set_environment_defaults, with_logging_defaults, with_model_defaults,
        with_platform_defaults)
    environment_lines = set_environment_defaults(argv, os.environ)
    on_cpu = not torch.cuda.is_available()
    check_gpu_request(argv, cuda_available=not on_cpu)  # a GPU recipe on a node without one
    if on_cpu:
        from moe_launcher import cpu_backend

        cpu_backend.fallback_warnings_from_rank_0_only()  # before activate(), which warns too
        cpu_backend.activate()

    from megatron_patches import registry

    registry.load_patches()
    for status in registry.apply_patches(registry.current_context(cpu_backend=on_cpu)):
        log0(status.line())
    argv, platform_lines = with_platform_defaults(argv, on_cpu=on_cpu)
    argv, model_lines = with_model_defaults(argv)
    argv, logging_lines = with_logging_defaults(argv)
    for line in platform_lines + model_lines + logging_lines + environment_lines:
        log0(line)

    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from moe_launcher.argument_dump import argument_block_kept, write_argument_block
    from moe_launcher.data import train_valid_test_datasets
    from moe_launcher.gpt_step import forward_step
    from moe_launcher.megatron_validation import checked_command_line, set_megatron_globals

    # Refuse a command line that cannot run before megatron initialises, builds or writes
    # anything: this project's checks, then megatron's own validation and config construction.
    with argument_block_kept() as argument_block:
        args, config = checked_command_line(argv)
    if line := write_argument_block(argument_block):
        log0(line)
    set_megatron_globals(args)
    log0(f"[pretrain_moe] megatron-core {track} track, "
         f"{'CPU backend (gloo)' if on_cpu else 'CUDA'}, transformer-impl {args.transformer_impl}")
    pretrain(config, train_valid_test_datasets, ModelType.encoder_or_decoder, forward_step)


def exit_refused(status: int) -> None:
    """Ends a refused run with `status`: the atexit handlers run (writer claims released, logs
    flushed), then the process ends without tearing the interpreter down. A refusal is raised
    right after the collective in which the ranks agreed on it; two gloo ranks that then went
    through the interpreter's finalization, one while the other still waited, aborted the first
    in C++ in 12 of 40 torchrun runs ("terminate called without an active exception", exit -6
    instead of the refusal's status); this way, 0 of 40. Nor can a thread left in a collective
    hold a refused rank's exit: finalization would wait for it."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run(argv: list[str]) -> None:
    """main() with the launcher's refusals: one line, no traceback, the exit status."""
    try:
        main(argv)
    except PreflightError as error:
        # Every rank refuses; rank 0 says why. The others linger a moment so that torchrun,
        # which stops the job at the first exit, does not stop rank 0 before it has printed.
        if int(os.environ.get("RANK", "0")) == 0:
            print(error.line(), file=sys.stderr, flush=True)
        else:
            import time
            time.sleep(5)
        exit_refused(PREFLIGHT_EXIT)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # torch's CheckpointException is a BaseException
        # A checkpoint save or load refused on purpose (also from inside torch's checkpoint
        # report): one line, no traceback; rank 0's alone where every rank refused alike. The
        # rank that prints exits at once, the others linger a moment, so that torchrun, which
        # stops the job at the first exit, does not stop the printer first.
        refusal = find_refusal(error)
        if refusal is None:
            raise
        line = refusal_line(refusal)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        if line is None or int(os.environ.get("RANK", "0")) == 0:
            import time
            time.sleep(2 if line is None else 0)
        exit_refused(1)


if __name__ == "__main__":
    run(sys.argv[1:])
