"""Run a recipe on a model bigger than memory: decoder layers read from disk, processed and written to
output shards one at a time, so peak memory follows one layer, not the model.

The same engine as in memory (`layerwise.run_layerwise`), with a lazy layer *source*
(`models.lazy.LazyLayers`) and a shard-writing *sink* (`sink.ShardSink`, over `formats.shards`). Each
stage runs through an adapter that hands the engine the in-memory stage's own per-layer function; the
stages of a recipe are composed into one `LayerFn` (`compress.compose`), so layer i gets every stage
before layer i+1 is read, and consecutive one-pass calibrated stages (SparseGPT/Wanda then GPTQ) share
one pass over the layer's inputs. Global magnitude pruning first finds its exact threshold in a
streaming pass over the checkpoint (`threshold.global_threshold` over `LazyTensors`).

Streamed: prune (magnitude global/layer/N:M, wanda, sparsegpt), quantize (int8, w8a8 with or without
SmoothQuant, rtn, gptq, awq, awq+gptq), written dense, compressed-tensors (int-quantized,
pack-quantized, sparse-bitmask), GPTQ v1 or AWQ GEMM through the format modules' own pack and config
functions (`output.py`). Not streamed (`decide.not_streamable` says so in one line): prune allocations
(owl, sensitivity), gptq mixed precision, distill, eval. Float outputs keep the input's dtype unless
the recipe's `output.dtype` is set. Modules outside the decoder layers (embeddings, final norm, head)
are read one at a time and written as they are (or quantized, for an int8 head not ignored).

Resume: the finished layers in the output shards are the resume state (`formats.shards`); a rerun of
the same command continues after the last finished one.

Modules: `decide` (whether to stream), `plan` (the stage adapters' table, the calibration dtypes),
`run` (the run), `sink` (output shards), `output` (the format a layer is written in), `estimate`
(memory and disk), `stage` (what an adapter is), one adapter per method family (`prune`, `int8`,
`rtn`, `gptq`, `awq`).
"""

from geminicompress.streaming.decide import AUTO_FRACTION, not_streamable, should_stream, source_dir
from geminicompress.streaming.estimate import BASE_BYTES, estimate
from geminicompress.streaming.gptq import gptq_dtypes
from geminicompress.streaming.run import run_streamed
from geminicompress.streaming.sink import ShardSink, module_tensors

__all__ = ["AUTO_FRACTION", "BASE_BYTES", "ShardSink", "estimate", "gptq_dtypes", "module_tensors", "not_streamable",
           "run_streamed", "should_stream", "source_dir"]
