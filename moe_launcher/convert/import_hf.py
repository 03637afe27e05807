"""import-hf: a Hugging Face MoE folder as a torch_dist checkpoint the launcher loads at any
layout (`OUT_DIR/release`, the tracker naming it), plus `OUT_DIR/model_flags.txt`, the
Megatron-LM flags of the architecture.

Everything that can be refused without reading the weights is refused before the output
folder is created: the family, the config keys, a tokenizer in the folder with more tokens than
config.json's vocab_size, every shard's header, each HF tensor's shape (against the one
config.json implies) and dtype, and every tensor's place in the model. The weights stream: the
model is built on the meta device and each megatron parameter is made from its HF tensors (read
once) when megatron's save writes it; a tensor holding NaN or Inf stops the conversion there,
and the staged output is removed. Block-wise FP8 weights (DeepSeek-V3's release) are
dequantized as they are read (`block_fp8`). Multi-token-prediction layers become megatron's MTP
layers where megatron can hold them (`_mtp_layers_imported`).
"""

from __future__ import annotations

import copy
import os

import torch

from . import megatron_side
from .block_fp8 import FP8, BlockFP8, block_fp8_of
from .architecture import aux_loss_weight_said, megatron_flags
from .errors import ConvertError
from .families import Family, family_of_architecture
from .hf_files import SAFETENSORS_DTYPES, TOKENIZER_FILES, HFTensors, read_config_json
from .staging import check_target, staged_folder
from .tensor_map import fuse, hf_shapes, mtp_copies, rules, unmapped

FLAGS_FILE = "model_flags.txt"
ROPE_BUFFER = ".rotary_emb.inv_freq"


def hf_config(family: Family, hf_dir: str):
    """The folder's config through the family's transformers class (its defaults filled in)."""
    import transformers

    return getattr(transformers, family.config_class).from_pretrained(hf_dir)


def check_tokenizer_fits(hf_dir: str, config, trust_remote_code: bool = False) -> None:
    """Where the folder holds a tokenizer (loaded as training loads it: megatron's
    HuggingFaceTokenizer), its ids must all have a row of config.json's vocab_size. A tokenizer
    that is code of the folder's own (Moonlight's, Kimi's) is loaded only with
    `trust_remote_code`; without it the check cannot judge, lets the import go on and says so."""
    if not any(os.path.isfile(os.path.join(hf_dir, name)) for name in TOKENIZER_FILES):
        return
    from moe_launcher.prepare_data.errors import PrepareError
    from moe_launcher.prepare_data.tokenizer import TokenizerCodeNotTrusted, load_tokenizer
    from moe_launcher.tokenizer_folder import own_code

    try:
        tokens = load_tokenizer(hf_dir, trust_remote_code).vocab_size
    except TokenizerCodeNotTrusted:
        print(f"convert: import-hf: the tokenizer in {hf_dir} is code of the folder's own "
              f"({own_code(hf_dir)}): its size is not checked against config.json's vocab_size "
              "(--trust-remote-code runs that code to check it)", flush=True)
        return
    except PrepareError as error:
        raise ConvertError(str(error)) from None
    if tokens > config.vocab_size:
        raise ConvertError(f"the tokenizer in {hf_dir} has {tokens} tokens, but config.json's "
                           f"vocab_size is {config.vocab_size}: ids from {config.vocab_size} up "
                           "would have no embedding row; fix: the folder's tokenizer and "
                           "config.json must belong to the same model")


def _check_header(name: str, found: tuple[tuple[int, ...], str], shape: tuple[int, ...],
                  dtype: torch.dtype) -> None:
    if found[0] != shape:
        raise ConvertError(f"{name} has shape {found[0]}, but config.json implies {shape}; fix: "
                           "the folder's config.json and weights must belong to the same model")
    # a cast would change the HF model's own values
    if found[1] != SAFETENSORS_DTYPES.get(dtype):
        named = {code: kind for kind, code in SAFETENSORS_DTYPES.items()}.get(found[1], found[1])
        raise ConvertError(f"{name} is {named}, not the {dtype} of config.json's dtype")


class _Weights:
    """Each megatron parameter from its HF tensors, read when the save asks for it. Built only
    after every shape and dtype (from the shards' headers), every HF tensor's place and every
    parameter's source are checked, so the only refusal left for the writing is a tensor's
    values (NaN or Inf) or a shard unreadable past its header: the staged output is removed."""

    def __init__(self, model, family: Family, config, tensors: HFTensors, left_out: list[str],
                 fp8: BlockFP8 | None):
        params = model.state_dict()
        self.tensors, self.config = tensors, config
        self.padded_vocab = model.embedding.word_embeddings.weight.shape[0]
        self.rules = {rule.megatron: rule for rule in rules(family, config)}
        self.dtypes = {name: params[name].dtype for name in self.rules}
        self.fp8, self.quantized = fp8, set()
        for rule in self.rules.values():
            target = params[rule.megatron]
            for name, shape in zip(rule.hf, hf_shapes(rule, tuple(target.shape), config)):
                found = tensors.header(name)
                if self.fp8 and found[1] == FP8:
                    scale = self.fp8.scale_of(name)
                    self.fp8.check(name, found, tensors.header(scale)
                                   if scale in tensors.weight_map else None)
                    found = (found[0], SAFETENSORS_DTYPES.get(target.dtype))
                    self.quantized.add(name)
                _check_header(name, found, shape, target.dtype)
        # rope buffers some checkpoints keep (Kimi K2's, one an attention layer): derived from
        # config.json, which megatron computes its rope from, as transformers and vLLM do
        self.rope_buffers = [name for name in tensors.weight_map if name.endswith(ROPE_BUFFER)]
        tensors.check_all_placed({name for rule in self.rules.values() for name in rule.hf}
                                 | {name for rule in mtp_copies(family, config) for name in rule.hf}
                                 | {self.fp8.scale_of(name) for name in self.quantized}
                                 | set(self.rope_buffers) | set(left_out))
        if unfilled := unmapped(params, family, config):
            raise ConvertError(f"the mapping leaves megatron parameters unset: "
                               f"{', '.join(unfilled[:3])}")

    def _source(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """An HF tensor as the model's weight: a block-wise FP8 one dequantized to `dtype`."""
        source = self.tensors.get(name)
        if name in self.quantized:
            source = self.fp8.dequantize(source, self.tensors.get(self.fp8.scale_of(name)), dtype)
        if source.is_floating_point() and not bool(torch.isfinite(source).all()):
            raise ConvertError(f"{name} holds NaN or Inf values (a damaged file or "
                               "download?); fix: download the model again")
        return source

    def read(self, megatron_name: str) -> torch.Tensor:
        rule = self.rules[megatron_name]
        sources = [self._source(name, self.dtypes[megatron_name]) for name in rule.hf]
        return fuse(rule, sources, self.config, self.padded_vocab)


def _mtp_layers_imported(family: Family, config, tensors: HFTensors):
    """The config as imported and the HF tensors left out. The multi-token-prediction layers
    become megatron's MTP layers, which share the main model's embedding and output layer: a
    layer's copies of those must equal the main model's. Where they differ, or the folder holds
    none of the layers' tensors, the layers are left out (the main model is the same) and a line
    says why."""
    layers = family.mtp_layers(config)
    if not layers:
        return config, []
    first = config.num_hidden_layers
    prefixes = tuple(f"model.layers.{first + k}." for k in range(layers))
    held = sorted(name for name in tensors.weight_map if name.startswith(prefixes))
    main = {rule.megatron: rule.hf[0] for rule in rules(family, config)}
    differ = [twin.hf[0] for twin in mtp_copies(family, config) if twin.hf[0] in held
              and not torch.equal(tensors.get(twin.hf[0]), tensors.get(main[twin.megatron]))]
    named = f"{layers} multi-token-prediction layer{'s' * (layers > 1)} (HF layer " \
            f"{', '.join(str(first + k) for k in range(layers))}, {family.mtp_layers_key})"
    if held and not differ:
        print(f"convert: import-hf: {named} imported as megatron's MTP layers (--mtp-num-layers "
              f"{layers}); config.json states no weight of their loss: megatron's "
              "--mtp-loss-scaling-factor (0.1 unless set) is the run's choice", flush=True)
        return config, []
    why = (f"{differ[0]} differs from the main model's, which megatron's MTP layers share"
           if differ else "the folder holds none of their tensors")
    print(f"convert: import-hf: {named} not imported: {why}", flush=True)
    config = copy.deepcopy(config)
    setattr(config, family.mtp_layers_key, 0)
    return config, held


def import_hf(hf_dir: str, out_dir: str, trust_remote_code: bool = False) -> None:
    check_target(out_dir)
    family = family_of_architecture(read_config_json(hf_dir).get("architectures"))
    config = hf_config(family, hf_dir)
    check_tokenizer_fits(hf_dir, config, trust_remote_code)
    # what megatron would build otherwise and a quantization not read here: refused before the
    # shards are opened
    megatron_flags(family, config)
    fp8 = block_fp8_of(getattr(config, "quantization_config", None))
    tensors = HFTensors(hf_dir)
    config, left_out = _mtp_layers_imported(family, config, tensors)
    flags = megatron_flags(family, config)
    megatron_side.start()
    args, model_config = megatron_side.args_of_flags(flags, config.max_position_embeddings)
    with torch.device("meta"):  # names and shapes: each weight is read as it is written
        model = megatron_side.build(model_config)
    weights = _Weights(model, family, config, tensors, left_out, fp8)
    if said := aux_loss_weight_said(family, config):
        print(f"convert: import-hf: {said}", flush=True)
    if weights.rope_buffers:
        print(f"convert: import-hf: {len(weights.rope_buffers)} {ROPE_BUFFER.lstrip('.')} buffers "
              "are not read: the rope is computed from config.json, as transformers and vLLM "
              "compute it", flush=True)
    if weights.quantized:
        print(f"convert: import-hf: {len(weights.quantized)} weights stored as block-wise FP8 "
              f"(blocks of {list(weights.fp8.block)}) are dequantized to "
              f"{str(model_config.params_dtype).removeprefix('torch.')}: each times its "
              "block's weight_scale_inv", flush=True)
    with staged_folder(out_dir) as staging:
        megatron_side.save_release(model, weights.read, args, staging)
        with open(os.path.join(staging, FLAGS_FILE), "w") as f:
            f.write(" ".join(flags) + "\n")
