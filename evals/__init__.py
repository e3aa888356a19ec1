"""Evaluation: perplexity under the wikitext (GPTQ/AWQ papers) and llama.cpp protocols, and
divergence from a base model as llama-perplexity --kl-divergence measures it."""
from .kld import BaseFile, Divergence, divergence, save_base
from .perplexity import PROTOCOLS, Perplexity, check_settings, llamacpp_arithmetic, perplexity, windows

__all__ = ["PROTOCOLS", "BaseFile", "Divergence", "Perplexity", "check_settings", "divergence", "llamacpp_arithmetic",
           "perplexity", "save_base", "windows"]
