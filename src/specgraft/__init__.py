"""specgraft: lossless speculative decoding with draft/retrieval trees, on stock Hugging Face models."""

from .engine import Engine, Generation, generate
from .errors import SpecgraftError
from .core.sampling import SamplingParams
from .core.stats import Stats
from .core.tree import Tree

__version__ = "0.1.0"
__all__ = ["Engine", "Generation", "SamplingParams", "SpecgraftError", "Stats", "Tree", "generate"]
