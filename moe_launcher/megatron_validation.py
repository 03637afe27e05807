"""megatron's own checks of a command line, run before any work; a failure is a refusal.

megatron checks its flags in `validate_args` and again when it builds its configs
(TransformerConfig.__post_init__, the pretrain config container). Left to itself a failed
check is a traceback on every rank (a bare AssertionError for some). Here the same functions
run, unchanged, before process groups, model or checkpoint exist, and a failure becomes a
`PreflightError`: one line naming the flags the failed check reads and megatron's reason.

megatron's `parse_and_validate_args` sets its globals (tokenizer, TensorBoard writer, which
creates --tensorboard-dir) between validating and the config, so the pieces run here in an
order where every check comes before anything is written: validation, the tokenizer (whose
vocabulary the config takes), the config, then the globals that write.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import enum
import functools
import os
import re
import sys
import traceback
from typing import NoReturn

from moe_launcher.runtime.refusals import PreflightError
from moe_launcher.tokenizer_folder import untrusted_own_code

# Names in megatron's checks that are config fields rather than flag destinations.
_CONFIG_FIELD_FLAGS = {"num_moe_experts": "--num-experts", "seq_length": "--seq-length"}


@functools.cache
def _flag_of_dest() -> dict[str, str]:
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return {action.dest: action.option_strings[0] for action in parser._actions
            if action.option_strings}


def _megatron_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the failure inside megatron's sources."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if f"{os.sep}megatron{os.sep}" in frame.filename]
    return frames[-1] if frames else None


def _flags_named(text: str) -> list[str]:
    """The Megatron-LM flags a check's message or source line refers to, in order."""
    known = _flag_of_dest()
    flags = re.findall(r"--[a-z0-9][a-z0-9_-]*", text)
    for attribute, name in re.findall(r"(args\.)?\b([A-Za-z_][A-Za-z0-9_]*)", text):
        flag = _CONFIG_FIELD_FLAGS.get(name) or known.get(name)
        # a bare word like "fp8" alone is too ambiguous; `args.bf16` in a check's source is not
        if flag and (attribute or "_" in name + flag):
            flags.append(flag)
    return [flag for i, flag in enumerate(flags) if flag in known.values() and
            flag not in flags[:i]]


def refusal(error: BaseException) -> PreflightError:
    frame = _megatron_frame(error)
    reason = " ".join(str(error).split()) or (frame.line if frame and frame.line else "")
    if isinstance(error, AssertionError) and not str(error) and frame and frame.line:
        reason = f"check failed: {frame.line.strip()}"
    where = (f" ({frame.filename.split(os.sep + 'megatron' + os.sep, 1)[-1]}:{frame.lineno})"
             if frame else "")
    flags = _flags_named(f"{error} {frame.line if frame else ''}")
    named = "/".join(flags[:4]) if flags else "the flags megatron's check names"
    return PreflightError(flags[0] if flags else "megatron",
                          f"{named}: megatron refuses this command line: "
                          f"{type(error).__name__}: {reason}{where}; fix: change {named} so "
                          "that megatron's check holds")


@contextlib.contextmanager
def megatron_refusals():
    """A failure of megatron's checks inside the block becomes a PreflightError."""
    try:
        yield
    except PreflightError:
        raise
    except Exception as error:  # noqa: BLE001 -- any failed check is a refusal, see refusal()
        raise refusal(error) from None


class _LastLineKept:
    """A text stream passed through, keeping the last non-blank line written to it."""

    def __init__(self, stream):
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> int:
        if lines := [line for line in text.splitlines() if line.strip()]:
            self.last = lines[-1]
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def megatron_exits_refused():
    """megatron-core 0.19.2's validate_args ends the process with exit() for a flag it no longer
    takes (--checkpoint-activations), after printing why: exit status 0 on every rank, a job
    that reads as completed having trained nothing. Inside the block such an exit is a refusal
    that quotes the line megatron printed last. (Not around megatron's globals: wandb, started
    there, takes over the stdout it finds. --adlr-autoresume, whose missing userlib megatron
    answers there with an exit too, is refused by its requirement in dependencies.py.)"""
    printed = _LastLineKept(sys.stdout)
    try:
        with contextlib.redirect_stdout(printed):
            yield
    except SystemExit as stop:
        stop.args = (printed.last,)
        raise refusal(stop) from None


def validated_args(args: argparse.Namespace) -> argparse.Namespace:
    """megatron's validation of parsed args (as in parse_and_validate_args, globals not set)."""
    with megatron_refusals(), megatron_exits_refused():
        if args.use_checkpoint_args:
            from megatron.training.checkpointing import load_args_from_checkpoint

            load_args_from_checkpoint(args, load_arg="pretrained_checkpoint")
            load_args_from_checkpoint(args)
        from megatron.training.arguments import validate_args

        validate_args(args, {})
        return args


def model_config(args: argparse.Namespace):
    """megatron's model config (GPT, or HybridModel for --hybrid-layer-pattern) for validated
    args."""
    from megatron.training.argument_utils import gpt_config_from_args

    with megatron_refusals():
        if args.hybrid_layer_pattern:
            from moe_launcher.model.hybrid_spec import hybrid_model_config
            return hybrid_model_config(args)
        return gpt_config_from_args(args)


def pretrain_config(args: argparse.Namespace):
    """megatron's pretrain config container (with the model config) for validated args."""
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    config = model_config(args)
    with megatron_refusals():
        return pretrain_cfg_container_from_args(args, config)


def build_megatron_tokenizer(args: argparse.Namespace) -> None:
    """megatron's tokenizer for validated args, built where megatron's parse_and_validate_args
    builds it: after validation and before the model config, which takes its vocabulary size
    from it (megatron sets --padded-vocab-size from the tokenizer's vocabulary, e.g. a
    HuggingFaceTokenizer's len(tokenizer)), so a run names its tokenizer and no --vocab-size.
    megatron's rebuild_tokenizer keeps it as megatron's tokenizer (set_megatron_globals does not
    build another). A tokenizer that cannot be built is refused."""
    from megatron.training.global_vars import rebuild_tokenizer

    if (args.tokenizer_type == "HuggingFaceTokenizer" and not args.trust_remote_code
            and (code := untrusted_own_code(args.tokenizer_model))):
        raise PreflightError(
            "--trust-remote-code",
            f"--tokenizer-model {args.tokenizer_model}: the tokenizer is code of the folder's "
            f"own ({code}), which megatron runs only with --trust-remote-code; fix: pass "
            "--trust-remote-code if you trust that code (train.sh: "
            "EXTRA_ARGS=--trust-remote-code)")
    with megatron_refusals():
        tokenizer = rebuild_tokenizer(args)
    _model_rows_from_vocab_size(args, tokenizer)


def _model_rows_from_vocab_size(args: argparse.Namespace, tokenizer) -> None:
    """A Hugging Face tokenizer with --vocab-size: the model gets --vocab-size's rows (padded),
    as an imported model's embedding has them (Qwen3: 151,936 rows for 151,669 tokens), where
    megatron would size it from the tokenizer and ignore the flag (its export then names a
    vocabulary its rows do not have). A --vocab-size below the tokenizer's is refused: its
    last ids would have no row."""
    if args.tokenizer_type != "HuggingFaceTokenizer" or not args.vocab_size:
        return
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    tokens = tokenizer.vocab_size
    if args.vocab_size < tokens:
        raise PreflightError("--vocab-size",
                             f"--vocab-size {args.vocab_size} is below the {tokens} tokens of "
                             f"--tokenizer-model {args.tokenizer_model}: its ids from "
                             f"{args.vocab_size} up would have no embedding row; fix: drop "
                             f"--vocab-size (the tokenizer's size, padded) or pass at least "
                             f"{tokens}")
    from_tokenizer = args.padded_vocab_size
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args,
                                                     logging_enabled=False)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[pretrain_moe] model vocabulary: --vocab-size {args.vocab_size} "
              f"({args.padded_vocab_size} rows, padded) for the tokenizer's {tokens} tokens "
              f"(megatron alone would give the model {from_tokenizer})", flush=True)


def set_megatron_globals(args: argparse.Namespace) -> None:
    """megatron's other globals (loggers, timers); the tokenizer is build_megatron_tokenizer's."""
    from megatron.training.global_vars import set_global_variables

    with megatron_refusals():
        set_global_variables(args, build_tokenizer=False)


def _help_printable(parser: argparse.ArgumentParser) -> None:
    """argparse expands every help string with `%` when it prints `--help`, and megatron-core
    0.19.2 has a help string with a bare `%` (--moe-paged-stash-buffer-size-factor-cuda: "(e.g.
    1.10 = 10%)."): `pretrain_moe.py --help` died with a ValueError traceback instead of listing
    the flags. In a help string that does not expand, each `%` that starts no `%(name)s` field
    is written as `%%`, which prints as itself."""
    for action in parser._actions:
        if action.help and "%" in action.help:
            try:
                action.help % collections.defaultdict(str)
            except (ValueError, TypeError):
                action.help = re.sub(r"%(?![(%])", "%%", action.help)


def _refuse_yaml_config(path: str) -> NoReturn:
    """--yaml-cfg's value, refused as argparse reads it: megatron's parse_args replaces the
    parsed flags by the YAML file's namespace right after parsing, and nothing after that
    sees a flag of the command line. The flags this launcher supplies (the CPU backend's,
    logging) and checks would silently not apply; nor does megatron-core 0.19.2 get through its
    own parse_args with it: its example config (Megatron-LM examples/gpt3/gpt_config.yaml) has
    no `disable_msc_deprecated`, which parse_args reads next (AttributeError on every rank)."""
    raise PreflightError(
        "--yaml-cfg",
        f"--yaml-cfg {path}: megatron's experimental YAML arguments replace the whole command "
        "line, so every flag (the launcher's defaults and checks included) would be ignored, "
        "and megatron-core's parse_args fails on them; fix: pass the settings as Megatron-LM "
        "flags (`python pretrain_moe.py --help` lists them)")


def _enum_member(convert, members):
    """megatron's conversion of an enum flag's value (--attention-backend, --exit-signal) looks
    the name up in the enum and raises KeyError for one it does not know, which argparse lets
    through as a traceback; here it is argparse's invalid-choice error."""
    def enum_member(value: str):
        try:
            return convert(value)
        except KeyError:
            names = ", ".join(choice.name for choice in members)
            raise argparse.ArgumentTypeError(
                f"invalid choice: {value!r} (choose from {names})") from None

    return enum_member


def _launcher_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """megatron's parser (its own instance, through megatron's hook for it) with errors (an
    unknown flag, a bad value, an enum name megatron does not know) as refusals instead of
    argparse's usage text and exit or a traceback, a `--help` that prints, and --yaml-cfg
    refused (see _refuse_yaml_config)."""
    def refuse(message: str):
        flags = re.findall(r"--[a-z0-9][a-z0-9_-]*", message)
        flag = flags[0] if flags else "the command line"
        raise PreflightError(flag, f"{message}; fix: correct {flag} (`python pretrain_moe.py "
                                   "--help` lists every flag)")

    parser.error = refuse
    for action in parser._actions:
        if action.dest == "yaml_cfg":
            action.type = _refuse_yaml_config
        elif action.choices and all(isinstance(choice, enum.Enum) for choice in action.choices):
            action.type = _enum_member(action.type, action.choices)
    _help_printable(parser)
    return parser


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """megatron's parser on argv (megatron reads sys.argv: it is set to argv); a parser error
    raises PreflightError, as does a check megatron makes as it parses (--enable-msc without
    the multistorageclient package: a RuntimeError on every rank)."""
    from megatron.training.arguments import parse_args

    sys.argv = [sys.argv[0], *argv]
    with megatron_refusals():
        return parse_args(extra_args_provider=_launcher_parser)


def checked_command_line(argv: list[str]):
    """Every check a command line gets before any work: megatron's parser, this project's
    preflight checks (moe_launcher.preflight, .checkpoint_paths, .dependencies), megatron's
    validation, its tokenizer and its config construction. Returns (args, pretrain config);
    raises PreflightError."""
    # Importing the check modules registers their checks.
    from moe_launcher import checkpoint_paths, dependencies, preflight  # noqa: F401

    args = parse_command_line(argv)
    preflight.check_args(args)
    args = validated_args(args)
    build_megatron_tokenizer(args)
    return args, pretrain_config(args)
