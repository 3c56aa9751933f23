"""specgraft: lossless speculative decoding with draft/retrieval trees, on stock Hugging Face models."""

from .decode import Engine, Generation, generate
from .errors import SpecgraftError
from .sampling import SamplingParams
from .stats import Stats
from .tree import Tree

__version__ = "0.1.0"
__all__ = ["Engine", "Generation", "SamplingParams", "SpecgraftError", "Stats", "Tree", "generate"]
