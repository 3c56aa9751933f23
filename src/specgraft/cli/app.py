"""The ``specgraft`` command line: one Typer app; each command module registers its commands on it.

Errors caused by input or environment print one line (``error: ...``) and exit with status 2. Commands import
what they need when they run, so that ``specgraft --help`` and a bad flag answer without loading torch models.
"""

from __future__ import annotations

import sys

import typer

from ..errors import SpecgraftError
from ..registry import DEFAULTS

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="Lossless speculative decoding with draft/retrieval trees.")

DEFAULTS_HELP = "; ".join(f"{m}: " + ", ".join(f"{k}={v}" for k, v in d.items()) for m, d in DEFAULTS.items())


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main() -> None:
    try:
        app()
    except SpecgraftError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
