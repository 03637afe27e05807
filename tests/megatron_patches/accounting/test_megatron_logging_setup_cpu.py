"""megatron-logging-setup: megatron-core 0.19.2 sets its log handler and INFO level with a
`logging.basicConfig` at import, which does nothing once absl's first log (emerging-optimizers'
registry, imported by megatron's optimizer package first) has given the root logger a handler of
its own: every INFO record of megatron was dropped. The reference is the record megatron's
gradient buffer logs at INFO for every run it wraps in DDP, "Number of buckets for gradient
all-reduce / reduce-scatter": there with the patch, gone without."""

from __future__ import annotations

from _launch import TINY_MODEL, launch

NAME = "megatron-logging-setup"
RUN = [*TINY_MODEL, "--train-iters", "1"]
RECORD = "Number of buckets for gradient all-reduce / reduce-scatter"


def test_megatrons_info_records_are_logged():
    import emerging_optimizers  # noqa: F401  (the lock's; what takes the root logger first)

    patched = launch(1, RUN).check()
    assert f"[megatron_patches] {NAME}: applied" in patched.log, patched.log[-3000:]
    assert RECORD in patched.log, patched.log[-3000:]
    unpatched = launch(1, RUN, env={"MEGATRON_PATCHES_DISABLE": NAME}).check()
    assert RECORD not in unpatched.log and "lm loss" in unpatched.log
