"""Drafter registry: method name -> constructor, with each method's defaults in one place."""

from __future__ import annotations

from ..errors import SpecgraftError
from .base import DraftContext, Drafter, NoDraft
from .draft_model import DraftModelDrafter
from .pld import PromptLookup
from .recycling import TokenRecycling

# Per-method defaults, printed by `specgraft generate --help` and written into every record.
DEFAULTS: dict[str, dict] = {
    "ar": {"budget": 0},
    "pld": {"budget": 10, "max_ngram": 3},
    "recycle": {"budget": 80, "k": 8, "scope": "cold"},
    "draft": {"budget": 4, "model": "qwen2.5-coder-0.5b", "shape": "chain", "top_k": 8, "depth": 5},
}
METHODS = tuple(DEFAULTS)


def make_drafter(method: str, vocab_size: int, dtype: str = "float32", **options) -> Drafter:
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
        if method == "draft":
            return _draft_model(opts["model"], vocab_size, dtype, opts["shape"], opts["top_k"], opts["depth"])
        return TokenRecycling(vocab_size, k=opts["k"], scope=opts["scope"])
    except (ValueError, TypeError) as err:
        raise SpecgraftError(str(err)) from err


def _draft_model(model, vocab_size: int, dtype: str, shape: str, top_k: int, depth: int) -> DraftModelDrafter:
    """``model``: a registry name, a local directory, or an already loaded ``nn.Module`` (tests)."""
    if isinstance(model, str):
        from ..models import load

        label = model
        model, _ = load(model, dtype)
    else:
        label = type(model).__name__
    draft_vocab = int(model.get_output_embeddings().weight.shape[0])
    if draft_vocab != vocab_size:
        raise SpecgraftError(f"draft model '{label}' has a vocabulary of {draft_vocab} tokens but the target has "
                             f"{vocab_size}; a draft model must share the target's tokenizer")
    return DraftModelDrafter(model, label, shape, top_k, depth)


__all__ = ["DraftModelDrafter", "DEFAULTS", "METHODS", "DraftContext", "Drafter", "NoDraft", "PromptLookup", "TokenRecycling",
           "make_drafter"]
