"""A local Hugging Face tokenizer folder: what `--tokenizer-model` names for
`--tokenizer-type HuggingFaceTokenizer`, and what prepare_data's `--tokenizer` names.

transformers' AutoTokenizer (megatron's HuggingFaceTokenizer calls it) takes any path that is
not a local folder for a hub model id and downloads it: on every rank of a job, a download
storm on a cluster and a failure offline. So the folder is checked before anything loads it.
Imports nothing heavy: prepare_data checks it before importing megatron."""

from __future__ import annotations

import os
import re

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# A Hugging Face hub model id: owner/name.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def folder_problem(path: str) -> str | None:
    """Why `path` is not a tokenizer folder (a clause naming it), or None."""
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES):
            return None
        return f"tokenizer folder {path} has neither tokenizer.json nor tokenizer_config.json"
    if os.path.exists(path):
        return f"{path} is a file, not a tokenizer folder"
    if is_hub_id(path):
        return (f"{path} is a Hugging Face hub id, not a local folder: every process that "
                "loads it would download it")
    return f"tokenizer folder {path} does not exist"


def is_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and not os.path.exists(path)


def download_hint(path: str) -> str:
    """How to make a local folder for `path`: its hub download, where it is a hub id."""
    hub_id = path if is_hub_id(path) else "<hub id>"
    return f"hf download {hub_id} --include 'tokenizer*' --local-dir DIR"


def own_code(path: str) -> str:
    """What a tokenizer folder loads from code of its own (its tokenizer_config.json's auto_map
    entry for AutoTokenizer, e.g. tokenization_moonshot.TikTokenTokenizer), for messages; ''
    where it names nothing. transformers runs that code only with trust_remote_code, and
    megatron's HuggingFaceTokenizer asks for it only with --trust-remote-code."""
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as file:
            entry = (json.load(file).get("auto_map") or {}).get("AutoTokenizer")
    except (OSError, ValueError, AttributeError):
        return ""
    classes = entry if isinstance(entry, list) else [entry]
    return ", ".join(sorted({name for name in classes if isinstance(name, str)}))


def needs_own_code(error: BaseException) -> bool:
    """Whether transformers refused to load a tokenizer because it would run the folder's own
    code (its ValueError asks for trust_remote_code=True)."""
    return "trust_remote_code" in str(error)
