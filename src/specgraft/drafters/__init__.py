"""Drafter registry: method name -> constructor, with each method's defaults in one place."""

from __future__ import annotations

from ..errors import SpecgraftError
from .base import DraftContext, Drafter, NoDraft
from .pld import PromptLookup
from .recycling import TokenRecycling

# Per-method defaults, printed by `specgraft generate --help` and written into every record.
DEFAULTS: dict[str, dict] = {
    "ar": {"budget": 0},
    "pld": {"budget": 10, "max_ngram": 3},
    "recycle": {"budget": 80, "k": 8, "scope": "cold"},
}
METHODS = tuple(DEFAULTS)


def make_drafter(method: str, vocab_size: int, **options) -> Drafter:
    """Build a drafter; ``options`` override ``DEFAULTS[method]`` (``budget`` is the loop's, not the drafter's)."""
    if method not in DEFAULTS:
        raise SpecgraftError(f"unknown method '{method}'; choose one of: {', '.join(METHODS)}")
    unknown = set(options) - set(DEFAULTS[method])
    if unknown:
        raise SpecgraftError(f"method '{method}' has no option(s) {sorted(unknown)}; it takes {sorted(DEFAULTS[method])}")
    opts = {**DEFAULTS[method], **options}  # "budget" belongs to the loop; drafters read it from the context
    try:
        if method == "ar":
            return NoDraft()
        if method == "pld":
            return PromptLookup(max_ngram=opts["max_ngram"])
        return TokenRecycling(vocab_size, k=opts["k"], scope=opts["scope"])
    except (ValueError, TypeError) as err:
        raise SpecgraftError(str(err)) from err


__all__ = ["DEFAULTS", "METHODS", "DraftContext", "Drafter", "NoDraft", "PromptLookup", "TokenRecycling",
           "make_drafter"]
