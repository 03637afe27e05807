"""Reads the history rows of a wandb offline run file (run-*.wandb).

The file is wandb's transaction log: a 7-byte header, then a LevelDB-style record log in 32 KiB
blocks (each chunk: crc32c 4 bytes, length 2, type 1; types FULL=1, FIRST=2, MIDDLE=3, LAST=4),
every record a serialized `wandb_internal_pb2.Record`.
"""

import json
import struct

from wandb.proto import wandb_internal_pb2

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes):
    position, pending = _HEADER, b""
    while position + _HEADER <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        if left_in_block < _HEADER:  # trailer padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + _HEADER])
        chunk = data[position + _HEADER:position + _HEADER + length]
        position += _HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
        else:  # zero-filled tail
            return


def history(path: str) -> list[dict]:
    """Every logged history row, as {key: value}."""
    rows = []
    with open(path, "rb") as run_file:
        data = run_file.read()
    for payload in _records(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
