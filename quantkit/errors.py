"""The one exception type users see: a problem with their input, told in one line with the fix."""


class QuantkitError(Exception):
    """A user-facing error. The CLI prints its message on one line and exits with code 2."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when empty), to quote inside a one-line error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
