"""Reading a Megatron-LM command line before megatron parses it (imports nothing heavy)."""

from __future__ import annotations


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value megatron's parser keeps for `flag`: its last occurrence, as `--flag VALUE` or
    `--flag=VALUE` (no abbreviations); None where it is not given."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value
