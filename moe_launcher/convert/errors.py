"""The one error type a conversion refuses with: printed as one `convert: error: ...` line on
stderr, exit status 2, and nothing left in the output folder's place."""

from moe_launcher.runtime.refusals import ToolError


class ConvertError(ToolError):
    tool = "convert"
