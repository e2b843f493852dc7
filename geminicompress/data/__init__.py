"""Text data: where it comes from (`sources`) and how it becomes token windows (`windows`)."""

from geminicompress.data.sources import check_data_spec, read_text
from geminicompress.data.windows import (FRAMES, Frame, calibration_windows, pack_windows, prefix_note, sample_windows,
                                         text_prefix, tokenize, vocab_of)

__all__ = ["check_data_spec", "read_text", "tokenize", "pack_windows", "sample_windows", "calibration_windows", "text_prefix",
           "prefix_note", "vocab_of", "Frame", "FRAMES"]
