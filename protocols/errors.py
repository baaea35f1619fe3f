"""The base of every error caused by the user's input (config, files, environment, model path)."""


class UserError(Exception):
    """Bad input, not a bug in marsi: the CLI prints its one-line message and exits with status 2."""
