"""Test helpers: real megatron-core GPT models on CPU (world size 1, gloo), measured FLOPs, and
the converter run in the test's process.

Without CUDA they rely on the CPU backend, which tests/conftest.py activates before collection.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

VOCAB = 128


@contextlib.contextmanager
def environment_kept():
    """os.environ as it was before the block. megatron writes to it as it builds a model (the
    attention backend's NVTE_*_ATTN), torch and a gloo world too; a test process that builds
    models in-process must not hand that on to what it launches later (tests/conftest.py)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update(before)


def convert(*argv: str) -> subprocess.CompletedProcess:
    """`python -m moe_launcher.convert ARGV` as its main() here (a process of its own spent ~6 s
    importing megatron per conversion): exit status 0, its stdout and stderr."""
    from moe_launcher.convert.__main__ import main

    out, err, saved_argv = io.StringIO(), io.StringIO(), list(sys.argv)
    try:
        with environment_kept(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(arg) for arg in argv])
    finally:
        sys.argv[:] = saved_argv  # megatron's parser replaces it
    assert code == 0, f"convert {argv[0]} failed ({code}):\n{err.getvalue()[-4000:]}"
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def init_world() -> None:
    """One-process gloo world with every model-parallel size 1 (idempotent)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234)


def tiny_config(**overrides):
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                  use_cpu_initialization=True, add_bias_linear=False,
                  attention_dropout=0.0, hidden_dropout=0.0)
    if overrides.get("num_moe_experts"):
        kwargs.update(moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=32,
                      moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
    kwargs.update(overrides)
    if kwargs.get("multi_latent_attention"):
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def _with_mla_on_the_local_spec(config) -> None:
    """megatron-core 0.19.2's local core attention builds MLA only with the launcher's patches
    (local-mla-core-attention), applied as pretrain_moe.py applies them."""
    if config.multi_latent_attention:
        from _unpatched import apply_all

        apply_all()


def _forget_previous_model_metrics() -> None:
    """megatron's MoE and MTP loss trackers are process-wide, with per-layer buffers sized by the
    first model that logged into them; each test builds a new model in the same process."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    destroy_moe_metrics_tracker()
    MTPLossLoggingHelper.tracker.clear()


def build_gpt(config, seq_length: int):
    """A GPTModel from megatron's local (non-TransformerEngine) specs, as pretrain builds it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )

    init_world()
    _forget_previous_model_metrics()
    _with_mla_on_the_local_spec(config)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    mtp_spec = None
    if config.mtp_num_layers:
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    with environment_kept():
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                        max_sequence_length=seq_length, mtp_block_spec=mtp_spec)


def build_hybrid(config, pattern: str, seq_length: int, vocab: int = VOCAB):
    """A HybridModel from the launcher's local stack spec, as pretrain builds it without TE."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from moe_launcher.model.hybrid_spec import local_hybrid_stack_spec

    init_world()
    _forget_previous_model_metrics()
    _with_mla_on_the_local_spec(config)
    spec = local_hybrid_stack_spec(config.normalization, config.num_moe_experts)
    if config.multi_latent_attention:
        spec.submodules.mla_layer = _local_mla_layer()
    with environment_kept():
        return HybridModel(config=config, hybrid_stack_spec=spec, vocab_size=vocab,
                           max_sequence_length=seq_length, hybrid_layer_pattern=pattern)


def _local_mla_layer():
    """An MLA (`+`) layer of megatron's local modules, for FLOPs only: the launcher's local
    hybrid spec has no `+` layer (it refuses one)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import (
        MLASelfAttention, MLASelfAttentionSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer, TransformerLayerSubmodules)

    backend = LocalSpecProvider()
    column = backend.column_parallel_linear()
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=backend.layer_norm(),
        self_attention=ModuleSpec(
            module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=column, linear_q_down_proj=column, linear_q_up_proj=column,
                linear_kv_down_proj=column, linear_kv_up_proj=column,
                core_attention=backend.core_attention(), linear_proj=backend.row_parallel_linear(),
                q_layernorm=IdentityOp, kv_layernorm=IdentityOp)),
        self_attn_bda=get_bias_dropout_add))


def train_step_loss(model, batch: int, seq_length: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (batch, seq_length))
    positions = torch.arange(seq_length).expand(batch, -1)
    causal = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), 1)[None, None]
    loss = model(ids, positions, causal, labels=ids,
                 loss_mask=torch.ones(batch, seq_length))
    return loss.sum()


def measured_flops(model, batch: int, seq_length: int) -> int:
    """FLOPs torch counts for one forward + backward of `model` (full S×S attention)."""
    with FlopCounterMode(display=False) as counter:
        train_step_loss(model, batch, seq_length).backward()
    return counter.get_total_flops()


def kept_for_backward(model, run, seq_length: int) -> int:
    """Bytes of the tensors autograd keeps while `run(hidden, mask)` runs on a batch of one
    sequence of `seq_length` (under torch's saved-tensor hooks; each storage once), the model's
    weights and the causal mask, which every layer shares, left out."""
    hidden = torch.randn(seq_length, 1, model.config.hidden_size,
                         dtype=model.config.params_dtype, requires_grad=True)
    mask = torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool).triu(1)
    left_out = {p.untyped_storage().data_ptr() for p in model.parameters()}
    left_out.add(mask.untyped_storage().data_ptr())
    kept: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in left_out:
            kept.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        run(hidden, mask)
    return sum(kept.values())
