"""export-hf: a launcher torch_dist checkpoint (any layout) as a Hugging Face folder that
`AutoModelForCausalLM.from_pretrained` loads: config.json from the args saved in the
checkpoint, sharded safetensors with their index, the tokenizer's files with --tokenizer.
"""

from __future__ import annotations

from . import megatron_side
from .architecture import hf_config_kwargs
from .families import family_of_args
from .hf_files import ShardWriter, copy_tokenizer
from .staging import check_target, staged_folder
from .errors import ConvertError
from .tensor_map import rules, split, unmapped


def export_hf(ckpt_dir: str, out_dir: str, iteration: int | None, tokenizer: str | None,
              max_shard_bytes: int) -> None:
    import transformers

    check_target(out_dir)
    path = megatron_side.iteration_dir(ckpt_dir, iteration)
    megatron_side.check_format(path)
    megatron_side.start()
    args = megatron_side.saved_args(path)
    family = family_of_args(args)
    model_config = megatron_side.world_one_config(args)
    dtype = str(model_config.params_dtype).removeprefix("torch.")
    config = getattr(transformers, family.config_class)(**hf_config_kwargs(family, args, dtype))
    model = megatron_side.build(model_config)
    megatron_side.load_into(model, path)
    params = model.state_dict()
    if dropped := unmapped(params, family, config):
        raise ConvertError(f"the checkpoint's {', '.join(dropped[:3])}"
                           f"{f' (and {len(dropped) - 3} more)' if len(dropped) > 3 else ''} map "
                           f"to no tensor of {family.architecture}: the export would drop them")
    # The family is judged from the args (an OLMoE-recipe run computes Qwen3-MoE's forward).
    print(f"convert: export-hf: {family.architecture}, the Hugging Face model whose forward the "
          f"checkpoint's args compute ({', '.join(f'{k}={v}' for k, v in family.marks.items())})",
          flush=True)
    with staged_folder(out_dir) as staging:
        if tokenizer:
            copy_tokenizer(tokenizer, staging)
        writer = ShardWriter(staging, max_shard_bytes)
        for rule in rules(family, config):
            for name, tensor in zip(rule.hf, split(rule, params[rule.megatron], config)):
                writer.add(name, tensor)
        writer.finish()
        config.save_pretrained(staging)
