"""Whether every node of a job sees the --save that rank 0 commits (issue 33).

A --save on node-local storage (/tmp, a local NVMe, a path each node mounts from its own disk)
is a different folder on every node under one name. megatron's torch_dist save has every rank
write its own files there and rank 0 the metadata, so each node keeps a part and no node holds a
checkpoint; the run still reports its saves as done. Name comparison cannot tell (the path is
the same everywhere), nor can inode numbers (NFS clients show their own device numbers): here
rank 0 writes a token file with a fresh name into --save and every rank looks for it. A node
that does not see it is named in one refusal, before the optimizer, the load and iteration 1.

Only multi-node jobs are judged (their ranks' node names differ): a one-node job's ranks share
its filesystem, and nothing is written for them. The token, and any folder rank 0 made to hold
it, are removed again whatever the verdict (a folder only while it is empty).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

from moe_launcher.runtime import collectives
from moe_launcher.runtime.refusals import PreflightError

TOKEN_PREFIX = "_node_view_"
WAIT_ENV = "MEGATRON_PATCHES_SAVE_VISIBILITY_WAIT_S"
# An NFS client may answer from a cached lookup of a folder that did not exist a moment ago
# (lookupcache; acdirmax defaults to 60 s): a node that does not see the token yet looks again
# for this long before it counts as not seeing it.
DEFAULT_WAIT_S = 60.0


def node_name() -> str:
    """The node as Slurm names it (what squeue and sinfo show), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _make_folders(path: str, made: list[str]) -> None:
    """Creates `path` and its missing parents, each folder made put first into `made` (deepest
    first), also when a later one cannot be made."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:  # made meanwhile by someone else: theirs
            continue
        made.insert(0, folder)


def _remove_empty(made: list[str]) -> None:
    """Removes the folders `_make_folders` made, deepest first, while they are empty."""
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:  # no longer empty: something else writes there now
            break


def _sees(token: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        if os.path.exists(token):
            return True
        if time.monotonic() >= deadline:
            return False
        # Listing the folders revalidates an NFS client's cached view of them.
        for folder in (os.path.dirname(token), os.path.dirname(os.path.dirname(token))):
            try:
                os.listdir(folder)
            except OSError:
                pass
        time.sleep(1.0)


def check_save_shared(save_dir: str, environ=os.environ) -> str | None:
    """On every rank of a multi-node job: raises PreflightError (every rank alike) where a node
    does not see the token rank 0 wrote into `save_dir`. Returns rank 0's line saying how many
    nodes saw it (None elsewhere, and for a one-node job)."""
    nodes = collectives.gather_objects(node_name())
    if len(set(nodes)) < 2:
        return None
    name, made, unwritable = None, [], None
    if collectives.rank() == 0:
        try:
            _make_folders(os.path.abspath(save_dir), made)
            handle, path = tempfile.mkstemp(prefix=TOKEN_PREFIX, dir=save_dir)
            os.close(handle)
            name = os.path.basename(path)
        except OSError as error:  # megatron's own save will report an unwritable --save
            unwritable = str(error)
            _remove_empty(made)
    # Every rank looks once rank 0 has written it, in --save as that rank resolves it.
    name, unwritable = collectives.gather_objects((name, unwritable))[0]
    if name is None:
        return (f"not judged whether every node sees it: rank 0 could not write there "
                f"({unwritable})" if collectives.rank() == 0 else None)
    token = os.path.join(save_dir, name)
    wait_s = float(environ.get(WAIT_ENV, DEFAULT_WAIT_S))
    seen = collectives.gather_objects(_sees(token, wait_s))
    if collectives.rank() == 0:
        os.unlink(token)
        _remove_empty(made)
    blind = sorted({node for node, saw in zip(nodes, seen) if not saw})
    if blind:
        raise PreflightError(
            "--save",
            f"--save {save_dir} is not one folder shared by the job's nodes: rank 0 on "
            f"{nodes[0]} wrote {name} into {os.path.abspath(save_dir)}, but {', '.join(blind)} "
            f"({len(blind)} of {len(set(nodes))} nodes) did not see it within {wait_s:g} s; on "
            f"node-local storage every node would keep only its own ranks' checkpoint files and "
            f"no node a whole checkpoint; fix: a --save (train.sh's CKPT_DIR) on a filesystem "
            f"every node mounts at the same path")
    if collectives.rank() == 0:
        return f"seen by all {len(set(nodes))} nodes of the job (one folder, shared)"
    return None
