"""Text data: where it comes from (`sources`) and how it becomes token windows (`windows`)."""

from geminicompress.data.sources import check_data_spec, read_text
from geminicompress.data.windows import calibration_windows, pack_windows, sample_windows, tokenize

__all__ = ["check_data_spec", "read_text", "tokenize", "pack_windows", "sample_windows", "calibration_windows"]
