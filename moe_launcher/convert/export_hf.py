"""export-hf: a launcher checkpoint (torch_dist, fsdp_dtensor or torch_dcp, any layout) as a Hugging
Face folder that `AutoModelForCausalLM.from_pretrained` loads: config.json from the args saved in
the checkpoint, sharded safetensors with their index, the tokenizer's files (--tokenizer's, else
those of the run's own --tokenizer-model folder when it trained with HuggingFaceTokenizer), and
with --config-from the source model's special token ids and generation_config.json (which no
checkpoint holds), once its config.json is checked to describe the same model. With
--fp8-weight-block-size the projection weights are written as block-wise FP8, as DeepSeek-V3's
release stores them (`block_fp8`).
"""

from __future__ import annotations

import os
import shutil

import torch

from . import megatron_side
from .architecture import aux_loss_weight_said, hf_config_kwargs
from .block_fp8 import BlockFP8, block_fp8_of, stored_as_fp8
from .families import family_of_args
from .hf_files import ShardWriter, copy_tokenizer, read_config_json, read_with_progress
from .staging import check_target, staged_folder
from .errors import ConvertError
from .tensor_map import GATE_UP, hf_shapes, mtp_copies, rules, split, unmapped


# What a checkpoint does not hold and --config-from supplies: the special token ids (and the
# folder's generation_config.json, copied).
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Derived keys that are training settings, not the model: --config-from may differ there.
_TRAINING_KEYS = {"dtype", "attention_dropout", "initializer_range", "router_aux_loss_coef"}
# Keys that say which layers are MoE layers, compared by the layers they make.
_LAYER_KEYS = {"mlp_only_layers", "decoder_sparse_step"}


def _source_config(config_from: str, family, derived: dict) -> dict:
    """config_from's config.json, once it describes the checkpoint's model: its architecture
    and every derived key but the training settings equal."""
    source = read_config_json(config_from)
    if source.get("architectures") != [family.architecture]:
        raise ConvertError(f"--config-from {config_from} is a {source.get('architectures')} "
                           f"config, the checkpoint a {family.architecture}")
    import transformers

    config_class = getattr(transformers, family.config_class)
    source_config = config_class(**source)
    known = source_config.to_dict()
    # the family's load-balancing keys are training settings too (DeepSeek's aux_loss_alpha), and
    # a run may train the model with or without its MTP layers (the export writes its own count)
    not_compared = _TRAINING_KEYS | _LAYER_KEYS | {family.aux_loss_key, family.seq_aux_key,
                                                   family.mtp_layers_key}
    for key, value in derived.items():
        # (None: a key the config leaves to its modelling code, e.g. Mixtral's head_dim)
        if key in not_compared or known.get(key) is None:
            continue
        # (a dict by the keys export writes: a published rope_scaling also keeps its legacy
        # "type")
        if isinstance(value, dict) and isinstance(known[key], dict):
            same = all(known[key].get(name) == part for name, part in value.items())
        else:
            same = known[key] == value
        if not same:
            raise ConvertError(f"--config-from {config_from} sets {key}={known[key]!r}, but the "
                               f"checkpoint's model has {value!r}: it is another model's config")
    # The same layers may be named otherwise (Qwen's decoder_sparse_step or mlp_only_layers).
    if family.moe_layers(source_config) != family.moe_layers(config_class(**derived)):
        raise ConvertError(f"--config-from {config_from} makes other layers MoE layers than the "
                           "checkpoint's model: it is another model's config")
    return source


def _run_tokenizer(args) -> str | None:
    """The tokenizer folder the run trained with, when it is one here (said either way)."""
    if getattr(args, "tokenizer_type", None) != "HuggingFaceTokenizer":
        return None
    folder = getattr(args, "tokenizer_model", None)
    if folder and os.path.isdir(folder):
        print(f"convert: export-hf: the tokenizer's files from the run's --tokenizer-model "
              f"{folder}", flush=True)
        return folder
    print(f"convert: export-hf: the run's --tokenizer-model {folder} is not a folder here, so no "
          f"tokenizer files are written; --tokenizer FOLDER adds them", flush=True)
    return None


def _fp8_names(mapping, params, fp8: BlockFP8) -> set[str]:
    """The HF tensors written as FP8, once every fused SwiGLU pair splits at a block edge:
    transformers and vLLM fuse gate_proj and up_proj again, with their scales, into one
    block-wise FP8 matrix."""
    names = set()
    for rule in filter(lambda rule: stored_as_fp8(rule.megatron), mapping):
        rows = params[rule.megatron].shape[0] // 2  # (of gate_proj, in a GATE_UP rule)
        if rule.layout == GATE_UP and rows % fp8.block[0]:
            raise ConvertError(f"--fp8-weight-block-size {fp8.block[0]},{fp8.block[1]}: "
                               f"{rule.hf[0]} has {rows} rows, not a multiple of {fp8.block[0]}, "
                               "and transformers and vLLM fuse it with its up_proj block by "
                               "block; fix: a block row size that divides it")
        names.update(rule.hf)
    return names


def _said_source_quantization(config_from: str, source_config: dict,
                              fp8: BlockFP8 | None) -> None:
    """A source stored as block-wise FP8 and an export that is not (or in other blocks): said,
    since the export is then another size (DeepSeek-V3: 1.3 TB in bf16, 0.7 TB as released)."""
    try:
        source = block_fp8_of(source_config.get("quantization_config"))
    except ConvertError:
        return
    if source and source != fp8:
        print(f"convert: export-hf: --config-from {config_from} is stored as block-wise FP8 "
              f"(blocks of {list(source.block)}), this export "
              f"{'in blocks of ' + str(list(fp8.block)) if fp8 else 'in full precision'}; "
              f"--fp8-weight-block-size {source.block[0]},{source.block[1]} writes it as the "
              "source is", flush=True)


def export_hf(ckpt_dir: str, out_dir: str, iteration: int | None, tokenizer: str | None,
              max_shard_bytes: int, config_from: str | None = None,
              fp8_block: tuple[int, int] | None = None) -> None:
    import transformers

    check_target(out_dir)
    path = megatron_side.iteration_dir(ckpt_dir, iteration)
    megatron_side.checkpoint_format(path)
    megatron_side.start()
    args = megatron_side.saved_args(path)
    family = family_of_args(args)
    model_config = megatron_side.world_one_config(args)
    dtype = str(model_config.params_dtype).removeprefix("torch.")
    with torch.device("meta"):  # shapes and names only: the weights stream from the checkpoint
        model = megatron_side.build(model_config)
    derived = hf_config_kwargs(family, args, dtype, megatron_side.moe_layers(model))
    source = _source_config(config_from, family, derived) if config_from else {}
    fp8 = BlockFP8(fp8_block) if fp8_block else None
    if config_from:
        _said_source_quantization(config_from, source, fp8)
    config = getattr(transformers, family.config_class)(
        **derived, **{key: source[key] for key in TOKEN_IDS if key in source})
    if not config_from:
        print(f"convert: export-hf: {', '.join(f'{key}={getattr(config, key, None)}' for key in TOKEN_IDS)}"
              f" are {family.config_class}'s defaults; --config-from the source model's folder "
              f"keeps its own (and its generation_config.json)", flush=True)
    tokenizer = tokenizer or _run_tokenizer(args)
    params = model.state_dict()
    if dropped := unmapped(params, family, config):
        raise ConvertError(f"the checkpoint's {', '.join(dropped[:3])}"
                           f"{f' (and {len(dropped) - 3} more)' if len(dropped) > 3 else ''} map "
                           f"to no tensor of {family.architecture}: the export would drop them")
    # The family is judged from the args (an OLMoE-recipe run computes Qwen3-MoE's forward).
    print(f"convert: export-hf: {family.architecture}, the Hugging Face model whose forward the "
          f"checkpoint's args compute ({', '.join(f'{k}={v}' for k, v in family.marks.items())})",
          flush=True)
    if said := aux_loss_weight_said(family, config):
        print(f"convert: export-hf: {said}", flush=True)
    reader = megatron_side.open_reader(model, path)
    # (each MTP layer's copies of the embedding and output head too, as DeepSeek-V3's
    # checkpoint holds them: vLLM's MTP loader reads them from there)
    mapping = rules(family, config) + mtp_copies(family, config)
    fp8_names = _fp8_names(mapping, params, fp8) if fp8 else set()
    planned = []
    for rule in mapping:
        for name, shape in zip(rule.hf, hf_shapes(rule, params[rule.megatron].shape, config)):
            if name in fp8_names:
                planned += [(name, shape, torch.float8_e4m3fn),
                            (fp8.scale_of(name), fp8.scale_shape(shape), torch.float32)]
            else:
                planned.append((name, shape, params[rule.megatron].dtype))
    if fp8:
        config.quantization_config = fp8.quantization_config(sorted(
            name.removesuffix(".weight") for name, shape, _ in planned
            if len(shape) == 2 and name.endswith(".weight") and name not in fp8_names))
    with staged_folder(out_dir) as staging:
        if tokenizer:
            copy_tokenizer(tokenizer, staging)
        writer = ShardWriter(staging, max_shard_bytes, planned)
        with read_with_progress(reader.read, model, "export-hf") as read:
            for rule in mapping:
                weight = read(rule.megatron)
                for name, tensor in zip(rule.hf, split(rule, weight, config)):
                    if name in fp8_names:
                        quantized, scale = fp8.quantize(tensor)
                        writer.add(name, quantized)
                        writer.add(fp8.scale_of(name), scale)
                    else:
                        writer.add(name, tensor)
                del weight
        writer.finish()
        config.save_pretrained(staging)
        generation = os.path.join(config_from or "", "generation_config.json")
        if config_from and os.path.isfile(generation):
            shutil.copy2(generation, staging)
