"""The one exception type the command-line tools turn into a one-line message and exit code 2."""


class LayerskipError(Exception):
    """A problem with the user's input: the message names the problem and how to fix it."""
