"""import-hf: a Hugging Face MoE folder as a torch_dist checkpoint the launcher loads at any
layout (`OUT_DIR/release`, the tracker naming it), plus `OUT_DIR/model_flags.txt`, the
Megatron-LM flags of the architecture.

Everything that can be refused is refused before the output folder is created: the family,
the config keys, a tokenizer in the folder with more tokens than config.json's vocab_size,
every shard's header, and each HF tensor as it is read (once, straight into the
megatron parameter it belongs to): its shape against the one config.json implies, its dtype, and
NaN or Inf in it.
"""

from __future__ import annotations

import os

import torch

from . import megatron_side
from .architecture import megatron_flags
from .errors import ConvertError
from .families import Family, family_of_architecture
from .hf_files import TOKENIZER_FILES, HFTensors, read_config_json
from .staging import check_target, staged_folder
from .tensor_map import fuse, hf_shapes, rules, unmapped

FLAGS_FILE = "model_flags.txt"


def hf_config(family: Family, hf_dir: str):
    """The folder's config through the family's transformers class (its defaults filled in)."""
    import transformers

    return getattr(transformers, family.config_class).from_pretrained(hf_dir)


def check_tokenizer_fits(hf_dir: str, config) -> None:
    """Where the folder holds a tokenizer (loaded as training loads it: megatron's
    HuggingFaceTokenizer), its ids must all have a row of config.json's vocab_size."""
    if not any(os.path.isfile(os.path.join(hf_dir, name)) for name in TOKENIZER_FILES):
        return
    from moe_launcher.prepare_data.errors import PrepareError
    from moe_launcher.prepare_data.tokenizer import load_tokenizer

    try:
        tokens = load_tokenizer(hf_dir).vocab_size
    except PrepareError as error:
        raise ConvertError(str(error)) from None
    if tokens > config.vocab_size:
        raise ConvertError(f"the tokenizer in {hf_dir} has {tokens} tokens, but config.json's "
                           f"vocab_size is {config.vocab_size}: ids from {config.vocab_size} up "
                           "would have no embedding row; fix: the folder's tokenizer and "
                           "config.json must belong to the same model")


def _check_tensor(name: str, source: torch.Tensor, shape: tuple[int, ...],
                  dtype: torch.dtype) -> None:
    if tuple(source.shape) != shape:
        raise ConvertError(f"{name} has shape {tuple(source.shape)}, but config.json implies "
                           f"{shape}; fix: the folder's config.json and weights must belong to "
                           "the same model")
    # copy_ would cast silently; the checkpoint keeps the HF model's own values.
    if source.dtype != dtype:
        raise ConvertError(f"{name} is {source.dtype}, not the {dtype} of config.json's dtype")
    if source.is_floating_point() and not bool(torch.isfinite(source).all()):
        raise ConvertError(f"{name} holds NaN or Inf values (a damaged file or download?); fix: "
                           "download the model again")


def _fill(model, family: Family, config, tensors: HFTensors) -> None:
    params = model.state_dict()
    padded_vocab = model.embedding.word_embeddings.weight.shape[0]
    with torch.no_grad():
        for rule in rules(family, config):
            target = params[rule.megatron]
            sources = [tensors.get(name) for name in rule.hf]
            shapes = hf_shapes(rule, tuple(target.shape), config)
            for name, source, shape in zip(rule.hf, sources, shapes):
                _check_tensor(name, source, shape, target.dtype)
            target.copy_(fuse(rule, sources, config, padded_vocab))
    tensors.check_all_read()
    if unfilled := unmapped(params, family, config):
        raise ConvertError(f"the mapping leaves megatron parameters unset: {', '.join(unfilled[:3])}")


def import_hf(hf_dir: str, out_dir: str) -> None:
    check_target(out_dir)
    family = family_of_architecture(read_config_json(hf_dir).get("architectures"))
    config = hf_config(family, hf_dir)
    check_tokenizer_fits(hf_dir, config)
    flags = megatron_flags(family, config)
    tensors = HFTensors(hf_dir)
    megatron_side.start()
    args, model_config = megatron_side.args_of_flags(flags, config.max_position_embeddings)
    model = megatron_side.build(model_config)
    _fill(model, family, config, tensors)
    with staged_folder(out_dir) as staging:
        megatron_side.save_release(model, args, staging)
        with open(os.path.join(staging, FLAGS_FILE), "w") as f:
            f.write(" ".join(flags) + "\n")
