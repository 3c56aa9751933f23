"""The ``specgraft`` command line (``specgraft.cli:main``): importing the command modules registers them."""

from . import generate  # noqa: F401, I001  (registration, in the order `--help` lists the commands)
from . import bench, serve, tools  # noqa: F401
from .app import app, main

__all__ = ["app", "main"]
