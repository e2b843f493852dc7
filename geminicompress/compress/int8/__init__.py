"""INT8 quantization: weight-only W8A16 (`int8`) and W8A8 with dynamic per-token activations (`w8a8`).

quant.py        per-channel / per-token symmetric INT8 math (pure)
smoothquant.py  SmoothQuant scales and folding, activation maxima from calibration
modules.py      Int8WeightOnlyLinear, W8A8Linear (fbgemm INT8 kernels on CPU)
stage.py        the pipeline stage
(its compressed-tensors `int-quantized` writer and loader: formats/int_quantized.py)
"""
