"""Quantizers: each a pure core, weights (and statistics) in, QuantizedTensor out."""
