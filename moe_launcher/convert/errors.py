"""The one error type a conversion refuses with: printed as one `convert: error: ...` line on
stderr, exit status 2, and nothing left in the output folder's place."""

EXIT_STATUS = 2


class ConvertError(Exception):
    def line(self) -> str:
        return f"convert: error: {self}"
