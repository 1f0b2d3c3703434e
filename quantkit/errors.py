"""The one exception type users see: a problem with their input, told in one line with the fix."""


class QuantkitError(Exception):
    """A user-facing error. The CLI prints its message on one line and exits with code 2."""
