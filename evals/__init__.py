"""Evaluation: perplexity under the wikitext (GPTQ/AWQ papers) and llama.cpp protocols."""
from .perplexity import PROTOCOLS, Perplexity, perplexity

__all__ = ["PROTOCOLS", "Perplexity", "perplexity"]
