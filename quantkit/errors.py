class QuantkitError(Exception):
    """Bad input: the message names the problem and how to fix it.

    The CLI prints it as one line and exits with status 2.
    """
