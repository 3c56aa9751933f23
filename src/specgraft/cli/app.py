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

DTYPE_HELP = ("bfloat16, float32 (the exact reference), auto (bfloat16 where oneDNN packs bf16 weights on this CPU "
              "- AVX-512 or AMX - else float32, whose packed step is the cheaper one from 3-4 tokens a forward "
              "there: trees and batches; on a GPU bfloat16, or float16 without bf16; --backend auto scores both "
              "CPU dtypes), or int4 (the GGUF's own 4-bit weights, CPU); on --backend llamacpp: gguf-q8 (a "
              "prepared copy of the GGUF whose tensors all take llama.cpp's batched kernels, re-quantised by "
              "llama.cpp; other values: the file as it is).")
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
