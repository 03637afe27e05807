"""The one error type a run refuses with: printed as one `prepare_data: error: ...` line, exit 2,
nothing written."""

from moe_launcher.runtime.refusals import ToolError


class PrepareError(ToolError):
    tool = "prepare_data"
