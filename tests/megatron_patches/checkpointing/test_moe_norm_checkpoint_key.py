"""moe-norm-checkpoint-key: an import-hf checkpoint (built on megatron's local spec) holds the
weight keys megatron's Transformer Engine spec saves and loads, which the GPU recipes build.

Reference: megatron-core 0.19.2's `get_gpt_layer_with_transformer_engine_submodules`
(gpt_layer_specs.py, the non-MLA branch with num_experts set), which cannot be built here
(`TESpecProvider` is None without Transformer Engine). TE_SPEC_WEIGHT_KEYS is recorded from it,
slot by slot, with the parameters each TE module has: linear_qkv is TELayerNormColumnParallelLinear
(`weight`, and the fused input norm's `layer_norm_weight`; input_layernorm is IdentityOp),
q/k_layernorm, pre_mlp_layernorm and the final norm are TENorm (`weight`), linear_proj is
TERowParallelLinear, the experts TEGroupedMLP, whose sharded state dict megatron makes
"interchangeable with SequentialMLP's" (experts.py); the layer's keys map is only the op-fuser's
`mlp.0`/`mlp.1`/`mlp.3` entries, none of which a MoE layer has. `_extra_state` entries are left
out: TE's are not recorded here (see README). The `gpu` test loads the import into the TE-spec
model itself where Transformer Engine and CUDA are present.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _megatron_cpu import convert
from _required import transformer_engine_missing

REPO = Path(__file__).resolve().parents[3]
PATCH = "moe-norm-checkpoint-key"

TE_SPEC_WEIGHT_KEYS = {
    "embedding.word_embeddings.weight",
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.self_attention.linear_qkv.weight",
    "decoder.layers.self_attention.q_layernorm.weight",
    "decoder.layers.self_attention.k_layernorm.weight",
    "decoder.layers.self_attention.linear_proj.weight",
    "decoder.layers.pre_mlp_layernorm.weight",
    "decoder.layers.mlp.router.weight",
    "decoder.layers.mlp.experts.experts.linear_fc1.weight",
    "decoder.layers.mlp.experts.experts.linear_fc2.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
}


def _import(hf: Path, out: Path) -> Path:
    convert("import-hf", hf, out)  # in this process, every patch applied
    return out


def _import_without_the_patch(hf: Path, out: Path) -> Path:
    """import-hf in a process of its own, where MEGATRON_PATCHES_DISABLE leaves the patch out."""
    run = subprocess.run([sys.executable, "-m", "moe_launcher.convert", "import-hf", str(hf),
                          str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
                              "MEGATRON_PATCHES_DISABLE": PATCH})
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def _weight_keys(ckpt: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(ckpt / "release")).read_metadata().state_dict_metadata
    return {key for key in metadata
            if "_extra_state" not in key and not key.startswith("common_state")}


@pytest.fixture(scope="module")
def qwen3_moe_folder(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (qk-norm, untied) saved by transformers."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    folder = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    config = Qwen3MoeConfig(vocab_size=200, hidden_size=64, intermediate_size=96,
                            moe_intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                            tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_an_import_holds_the_transformer_engine_specs_weight_keys(qwen3_moe_folder, tmp_path):
    patched = _weight_keys(_import(qwen3_moe_folder, tmp_path / "patched"))
    assert patched == TE_SPEC_WEIGHT_KEYS, (patched ^ TE_SPEC_WEIGHT_KEYS)
    # Without the patch the MoE layers' pre-MLP norm goes under the fused key of a dense TE
    # layer, which no TE MoE model asks for, and the key TE loads is absent.
    unpatched = _weight_keys(_import_without_the_patch(qwen3_moe_folder, tmp_path / "unpatched"))
    assert unpatched ^ TE_SPEC_WEIGHT_KEYS == {"decoder.layers.pre_mlp_layernorm.weight",
                                              "decoder.layers.mlp.linear_fc1.layer_norm_weight"}


@pytest.mark.gpu
@pytest.mark.skipif(transformer_engine_missing() is not None,
                    reason=transformer_engine_missing() or "")
def test_the_transformer_engine_spec_loads_an_import(qwen3_moe_folder, tmp_path):
    """The import loads into megatron's TE-spec GPTModel (the GPU recipes' model) and gives the
    local-spec model's logits."""
    import copy

    sys.path.insert(0, str(REPO / "tests"))
    from _megatron_cpu import init_world

    from moe_launcher.convert import megatron_side

    ckpt = _import(qwen3_moe_folder, tmp_path / "ckpt")
    init_world()
    path = megatron_side.iteration_dir(str(ckpt), None)
    args = megatron_side.saved_args(path)
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(16, device="cuda").expand_as(tokens)
    logits = {}
    for impl in ("local", "transformer_engine"):
        impl_args = copy.copy(args)
        impl_args.transformer_impl = impl
        impl_args.moe_grouped_gemm = impl == "transformer_engine"
        model = megatron_side.build(megatron_side.world_one_config(impl_args)).cuda()
        megatron_side.load_into(model, path)
        with torch.no_grad():
            logits[impl] = model.eval()(tokens, positions, None)
    torch.testing.assert_close(logits["transformer_engine"], logits["local"], rtol=1e-4,
                               atol=1e-4)
