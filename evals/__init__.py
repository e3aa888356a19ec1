"""Evaluation: perplexity under the wikitext (GPTQ/AWQ papers) and llama.cpp protocols."""
from .perplexity import PROTOCOLS, Perplexity, adds_bos, llamacpp_arithmetic, perplexity

__all__ = ["PROTOCOLS", "Perplexity", "adds_bos", "llamacpp_arithmetic", "perplexity"]
