"""Bytes of optimizer state per parameter element, by megatron's `--optimizer`: the one rule of
the dry-run planner (examples/moe/plan.py) and of the training log's weight-and-optimizer memory
line (megatron_patches/accounting/parameter_census.py).

megatron-core 0.19.2 keeps, per parameter element (judged against the tensors runs keep after
their first step in tests/moe_launcher/test_optimizer_memory_cpu.py):
* under mixed precision (bf16/fp16), an fp32 main copy (4 bytes);
* Adam: two fp32 moments; SGD: one momentum unless `--sgd-momentum 0`;
* emerging-optimizers' (Muon, adaptive Muon, Lion, ...): for each 2-D weight matrix that is
  neither the embedding nor the output layer, the optimizer's own state (Muon: one momentum;
  adaptive Muon: a momentum and a second moment; Lion: one moment); every other parameter
  (embeddings, output layer, norms, biases) goes to Adam, or for the two Muons to
  `--muon-scalar-optimizer` (Adam or Lion), and costs that optimizer's state.
Adam's rule was the only one before: a bf16 Muon run was priced 12 bytes per matrix element
where it needs 8.
Targets megatron-core 0.15.x - 0.19.x.
"""

from __future__ import annotations

import dataclasses

FP32 = 4

# fp32 state tensors per parameter element of Adam and Lion (also the scalar optimizers).
_MOMENTS = {"adam": 2, "lion": 1}
# fp32 state tensors per element of a 2-D weight matrix under emerging-optimizers' optimizers;
# their other parameters go to Adam, or for the Muons (platform_defaults.MUON_OPTIMIZERS) to
# --muon-scalar-optimizer.
_MATRIX_MOMENTS = {"muon": 1, "dist_muon": 1, "adaptive_muon": 2, "lion": 1}


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Optimizer bytes per parameter element, main copy included."""

    matrix: int  # a 2-D weight matrix other than the embedding and the output layer
    scalar: int  # the embedding, the output layer and every parameter that is not 2-D
    not_modelled: str = ""  # why Adam's rule stands in for the optimizer asked for

    def of(self, matrix_elements: float, scalar_elements: float) -> float:
        return self.matrix * matrix_elements + self.scalar * scalar_elements


def state_bytes(args) -> StateBytes:
    """The bytes megatron's optimizer keeps per parameter element for these parsed flags."""
    main_copy = FP32 if (args.bf16 or args.fp16) else 0

    def per_element(moments: int, not_modelled: str = "") -> StateBytes:
        return StateBytes(main_copy + FP32 * moments, main_copy + FP32 * moments, not_modelled)

    if getattr(args, "use_precision_aware_optimizer", False):
        return per_element(_MOMENTS["adam"], "--use-precision-aware-optimizer's state dtypes")
    if args.optimizer in _MATRIX_MOMENTS:
        from moe_launcher.platform_defaults import MUON_OPTIMIZERS

        scalar = _MOMENTS[args.muon_scalar_optimizer if args.optimizer in MUON_OPTIMIZERS
                          else "adam"]
        return StateBytes(main_copy + FP32 * _MATRIX_MOMENTS[args.optimizer],
                          main_copy + FP32 * scalar)
    if args.optimizer == "sgd":
        return per_element(1 if args.sgd_momentum else 0)
    if args.optimizer == "adam":
        return per_element(_MOMENTS["adam"])
    return per_element(_MOMENTS["adam"], f"--optimizer {args.optimizer}'s matrix state")
