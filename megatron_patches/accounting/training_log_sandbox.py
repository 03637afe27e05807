"""megatron's own `training_log`, run for a behaviour probe: its code object with its module's
globals, except stand-ins for the args, timers, writers, loggers and the rank-last print (a copy
of the globals: nothing of megatron is changed). Used by the patches that decide from what
megatron's training_log does whether they are needed (first-log-interval-reset,
moe-loss-names-by-type).
"""

from __future__ import annotations

import types


class ProbeArgs(types.SimpleNamespace):
    """megatron's args for a probe: the numbers training_log computes with; any other flag reads
    None (off)."""

    def __getattr__(self, name):
        return None


class _ProbeTimers:
    def __call__(self, name, *args, **kwargs):
        return self

    def elapsed(self, *args, **kwargs) -> float:
        return 1.0

    def log(self, *args, **kwargs) -> None:
        pass

    def write(self, *args, **kwargs) -> None:
        pass


def run_training_log(megatron_log, args: ProbeArgs, total_loss_dict: dict,
                     stand_ins: dict | None = None, **call) -> None:
    """megatron_log (megatron's unwrapped training_log) for `iteration` 1 of a one-rank run
    with `args`, no losses and no gradient norm; `stand_ins` replace more of its globals."""
    nothing = types.SimpleNamespace(track_app_tag=lambda *a, **k: None,
                                    track_e2e_metrics=lambda *a, **k: None)
    timers = _ProbeTimers()
    globals_ = {
        **megatron_log.__globals__,
        "get_args": lambda: args, "get_timers": lambda: timers,
        "get_tensorboard_writer": lambda: None, "get_wandb_writer": lambda: None,
        "get_one_logger": lambda: None, "get_energy_monitor": lambda: None,
        "one_logger_utils": nothing, "has_rl_utils": False, "get_num_microbatches": lambda: 1,
        "reduce_max_stat_across_model_parallel_group": lambda value, group=None: value,
        "num_floating_point_operations": lambda *a, **k: 0.0,
        "print_rank_last": lambda message: None, **(stand_ins or {})}
    sandboxed = types.FunctionType(megatron_log.__code__, globals_, megatron_log.__name__,
                                   megatron_log.__defaults__, megatron_log.__closure__)
    sandboxed.__kwdefaults__ = megatron_log.__kwdefaults__
    sandboxed(**{**dict(loss_dict={}, total_loss_dict=total_loss_dict, learning_rate=None,
                        iteration=1, loss_scale=1.0, report_memory_flag=False, skipped_iter=0,
                        grad_norm=None, params_norm=None, num_zeros_in_grad=None,
                        max_attention_logit=None), **call})


def one_rank_args(**numbers) -> ProbeArgs:
    """ProbeArgs of a one-rank run logging every iteration, with `numbers` on top."""
    return ProbeArgs(**{**dict(log_interval=1, tensorboard_log_interval=1, timing_log_level=0,
                               micro_batch_size=1, data_parallel_size=1,
                               gtp_weight_remat_size=1, seq_length=1, train_iters=2,
                               world_size=1, consumed_train_samples=0,
                               skipped_train_samples=0), **numbers})
