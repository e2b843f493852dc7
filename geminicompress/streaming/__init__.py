"""Run a recipe on a model bigger than memory: decoder layers read from disk, processed and written to
output shards one at a time, so peak memory follows one layer, not the model.

The same engine as in memory (`layerwise.run_layerwise`), with a lazy layer *source*
(`models.lazy.LazyLayers`) and a shard-writing *sink* (`sink.ShardSink`, over `formats.shards`). The
layer-local stages of the recipe are composed into one `LayerFn`, so layer i gets every stage before
layer i+1 is read. Global magnitude pruning first finds its exact threshold in a streaming pass over the
checkpoint (`threshold.global_threshold` over `LazyTensors`), then prunes in the layer pass.

Streamed today: prune (magnitude, global or per layer, N:M), quantize int8/w8a8 without SmoothQuant, and
quantize gptq (calibrated: layer 0's inputs come from the embeddings, read alone; each layer's quantized
outputs feed the next), written as dense, compressed-tensors int-quantized or GPTQ v1 checkpoints. Float outputs keep the input's dtype
unless the recipe's `output.dtype` is set. Modules outside the decoder layers (embeddings, final norm,
head) are read one at a time and written as they are (or quantized, for an int8 head not ignored).

Resume: the finished layers in the output shards are the resume state (`formats.shards`); a rerun of
the same command continues after the last finished one.

Modules: `decide` (whether to stream), `run` (the run), `sink` (output shards), `estimate` (memory and
disk), one per streamed stage (`prune`, `int8`, `gptq`).
"""

from geminicompress.streaming.decide import AUTO_FRACTION, not_streamable, should_stream, source_dir
from geminicompress.streaming.estimate import BASE_BYTES, estimate
from geminicompress.streaming.gptq import gptq_dtypes
from geminicompress.streaming.run import run_streamed
from geminicompress.streaming.sink import ShardSink, module_tensors

__all__ = ["AUTO_FRACTION", "BASE_BYTES", "ShardSink", "estimate", "gptq_dtypes", "module_tensors", "not_streamable",
           "run_streamed", "should_stream", "source_dir"]
