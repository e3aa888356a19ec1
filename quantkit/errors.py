class QuantkitError(Exception):
    """Bad input: the message names the problem and how to fix it.

    The CLI prints it as one line and exits with status 2.
    """


class ResumableError(QuantkitError):
    """A failure outside the input (a full disk): what was finished stays, and the same command resumes."""
