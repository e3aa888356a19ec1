"""Calibration data: text from a local file or a hub dataset, cut into seeded token windows."""
from .windows import load_text, sample_windows

__all__ = ["load_text", "sample_windows"]
