"""The one error type a conversion refuses with: printed as one `convert: error: ...` line on
stderr, exit status 2, and nothing left in the output folder's place."""

import contextlib

from moe_launcher.runtime.refusals import ToolError


class ConvertError(ToolError):
    tool = "convert"


@contextlib.contextmanager
def unwrapped_from_dcp():
    """A refusal raised while torch DCP writes (a tensor refused as it is read) comes out as
    itself, not inside DCP's CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        for failure in error.failures.values():
            if isinstance(failure, tuple) and isinstance(failure[0], ConvertError):
                raise failure[0] from None
        raise
