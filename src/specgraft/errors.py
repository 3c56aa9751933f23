"""User-facing errors: the CLI prints ``str(err)`` as one line and exits non-zero."""


class SpecgraftError(Exception):
    """An error caused by input or environment, with a message a user can act on."""
