from contextlib import contextmanager


class QuantkitError(Exception):
    """Bad input: the message names the problem and how to fix it.

    The CLI prints it as one line and exits with status 2.
    """


class ResumableError(QuantkitError):
    """A failure outside the input (a full disk): what was finished stays, and the same command resumes."""


def one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


@contextmanager
def untrusted(path, what: str, fix: str):
    """Around another library's parsing of a file we were given (a config, a tokenizer, a GGUF's
    metadata): whatever it raises on bad contents becomes a QuantkitError naming the file. Running
    out of memory is not bad contents, so it is not caught."""
    try:
        yield
    except (QuantkitError, MemoryError):
        raise
    except Exception as e:
        raise QuantkitError(f"{path}: {what} ({type(e).__name__}: {one_line(e)}): {fix}") from None
