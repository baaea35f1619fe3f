"""The base of every error caused by the user's input (config, files, environment, model path)."""


class UserError(Exception):
    """Bad input, not a bug in marsi: the CLI prints its one-line message and exits with status 2."""


def one_line(exc: BaseException) -> str:
    """The exception's message with every run of whitespace (newlines too) folded to one space."""
    return " ".join(str(exc).split())


def describe(exc: BaseException) -> str:
    """`Type: message` on one line."""
    return f"{type(exc).__name__}: {one_line(exc)}"
