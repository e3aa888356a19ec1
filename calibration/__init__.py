"""Calibration data: text from a local file or a hub dataset, cut into seeded token windows; or\nllama.cpp's importance matrix read from its file."""
from . import imatrix
from .windows import load_text, sample_windows

__all__ = ["imatrix", "load_text", "sample_windows"]
