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
