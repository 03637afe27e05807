"""python -m moe_launcher.convert {import-hf,export-hf,to-torch-dist,to-fsdp-dtensor} ...; a refusal
is one line, exit 2."""

from __future__ import annotations

import argparse
import os
import re
import sys

from moe_launcher.runtime.refusals import EXIT_STATUS

from .errors import ConvertError
from .fsdp_dtensor import SPECS

_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def shard_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]I?B)?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MB or 1000000")
    return int(match.group(1)) * _UNITS[match.group(2) or ""]


def block_size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", text)
    if not match or not all(int(size) > 0 for size in match.groups()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a block size like 128,128 (rows, "
                                         "columns)")
    return int(match.group(1)), int(match.group(2))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other refusal (argparse adds the usage)
        raise ConvertError(message)


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="python -m moe_launcher.convert",
                  description="Hugging Face MoE models <-> the launcher's checkpoints, "
                              "and torch_dist <-> fsdp_dtensor")
    commands = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    imp = commands.add_parser("import-hf", help="a HF folder -> a torch_dist checkpoint and "
                                                "OUT_DIR/model_flags.txt")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    imp.add_argument("--trust-remote-code", action="store_true",
                     help="load a tokenizer that is code of the folder's own (Moonlight's, "
                          "Kimi's), running that code, to check its size against config.json")
    exp = commands.add_parser("export-hf", help="a torch_dist, fsdp_dtensor or torch_dcp "
                                                "checkpoint -> a HF folder")
    exp.add_argument("ckpt_dir")
    exp.add_argument("out_dir")
    exp.add_argument("--iteration", type=int, help="default: the tracker's iteration")
    exp.add_argument("--tokenizer", help="a folder whose tokenizer files are copied (default: "
                                         "the run's --tokenizer-model folder, for a run with "
                                         "HuggingFaceTokenizer)")
    exp.add_argument("--config-from", help="the source model's folder: its config.json's token "
                                           "ids and its generation_config.json (checked to be "
                                           "this model's config)")
    exp.add_argument("--max-shard-size", type=shard_bytes, default="5GB",
                     help="largest safetensors shard (default 5GB)")
    exp.add_argument("--fp8-weight-block-size", type=block_size, metavar="ROWS,COLUMNS",
                     help="write the attention and MLP projection weights as block-wise FP8 "
                          "in blocks of this size, a float32 scale a block (DeepSeek-V3's "
                          "release format: 128,128); default: full precision")
    to_dist = commands.add_parser("to-torch-dist", help="an fsdp_dtensor (or torch FSDP2's "
                                                        "torch_dcp) checkpoint's weights -> a "
                                                        "torch_dist release")
    to_fsdp = commands.add_parser("to-fsdp-dtensor", help="a torch_dist checkpoint's weights "
                                                          "(an import) -> an fsdp_dtensor release")
    for command in (to_dist, to_fsdp):
        command.add_argument("ckpt_dir")
        command.add_argument("out_dir")
        command.add_argument("--iteration", type=int, help="default: the tracker's iteration")
    to_fsdp.add_argument("--transformer-impl", choices=SPECS, default="transformer_engine",
                         help="the spec of the run that will load it, whose module names the "
                              "checkpoint uses (default transformer_engine: the GPU recipes; "
                              "local: CPU runs)")
    return top


def main(argv: list[str] | None = None) -> int:
    # Local folders only: transformers never asks the Hub for anything here.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        options = parser().parse_args(argv)
        if options.command == "import-hf":
            from .import_hf import import_hf

            import_hf(options.hf_dir, options.out_dir, options.trust_remote_code)
        elif options.command == "to-torch-dist":
            from .change_format import to_torch_dist

            to_torch_dist(options.ckpt_dir, options.out_dir, options.iteration)
        elif options.command == "to-fsdp-dtensor":
            from .change_format import to_fsdp_dtensor

            to_fsdp_dtensor(options.ckpt_dir, options.out_dir, options.iteration,
                            options.transformer_impl)
        else:
            from .export_hf import export_hf

            export_hf(options.ckpt_dir, options.out_dir, options.iteration, options.tokenizer,
                      options.max_shard_size, options.config_from,
                      options.fp8_weight_block_size)
    except ConvertError as error:
        print(error.line(), file=sys.stderr, flush=True)
        return EXIT_STATUS
    print(f"convert: {options.command} wrote {os.path.abspath(options.out_dir)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
