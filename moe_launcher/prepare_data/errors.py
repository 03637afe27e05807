"""The one error type a run refuses with: printed as one `prepare_data: error: ...` line, exit 2."""


class PrepareError(Exception):
    pass
