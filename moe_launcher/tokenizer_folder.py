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


def _tokenizer_config(path: str) -> dict:
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _own_classes(path: str) -> list[str]:
    """The classes a tokenizer folder's tokenizer_config.json loads from code of its own (its
    auto_map entry for AutoTokenizer, or the older list form: e.g.
    tokenization_moonshot.TikTokenTokenizer)."""
    auto_map = _tokenizer_config(path).get("auto_map")
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    classes = entry if isinstance(entry, list) else [entry]
    return sorted({name for name in classes if isinstance(name, str)})


def own_code(path: str) -> str:
    """The classes of the folder's own code its tokenizer is, for messages ('' for none)."""
    return ", ".join(_own_classes(path))


def own_code_files(path: str) -> list[str]:
    """The Python files in the folder that its tokenizer's own classes are defined in
    (tokenization_moonshot.py); a class of another repository's code (`repo--module.Class`) is
    not in the folder."""
    modules = {name.rsplit(".", 1)[0] + ".py" for name in _own_classes(path) if "--" not in name}
    return sorted(name for name in modules if os.path.isfile(os.path.join(path, name)))


def untrusted_own_code(path: str) -> str:
    """The classes of the folder's own code that its tokenizer is, where transformers has no
    class of the name tokenizer_config.json gives ('' otherwise). transformers' AutoTokenizer
    (megatron's HuggingFaceTokenizer calls it) runs that code only with trust_remote_code;
    without it, a tokenizer-only folder fails to load, and a model folder (config.json beside)
    gets a tokenizer of another class built from the vocabulary files: for a tiktoken file,
    other tokens, silently. Where transformers has the named class it loads that, as it does
    whatever is asked. Imports transformers only for a folder that names code of its own."""
    classes = _own_classes(path)
    if not classes:
        return ""
    name = _tokenizer_config(path).get("tokenizer_class")
    if isinstance(name, str):
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

        base = name.removesuffix("Fast")
        if tokenizer_class_from_name(base) or tokenizer_class_from_name(base + "Fast"):
            return ""
    return ", ".join(classes)
