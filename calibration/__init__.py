"""Calibration data: text from a local file (chat records rendered by the model's template) or a hub
dataset, cut into seeded token windows; or llama.cpp's importance matrix read from its file."""
from . import imatrix, records
from .windows import chats, load_text, read_file, sample_windows, token_ids

__all__ = ["chats", "imatrix", "load_text", "read_file", "records", "sample_windows", "token_ids"]
