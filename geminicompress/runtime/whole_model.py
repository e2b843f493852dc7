"""The whole-model fallback (issue #36): what needs no structure runs on any model whose linears we can name.

Every layer-by-layer method walks decoder layers (engine/walk.py). When the trace finds none (no list of
repeated blocks holding linears: `core.trace.find_layers`), three methods still need nothing but the linear
weights and run here, on the whole model in memory:
- global magnitude pruning: one threshold over every targeted linear's |w| (`compress/prune/whole_model.py`);
- RTN b-bit: each weight rounded alone (`compress/rtn/whole_model.py`);
- INT8 weight-only (`int8`), and `w8a8` without SmoothQuant: each linear swapped for its INT8 module
  (`compress/int8/whole_model.py`).
Each method says what it needs of decoder layers and what it refuses on the whole model (`Method.needs_layers`,
`whole_model_refusal`: asked when the run is planned, plan.py) and runs its own pass (`Method.whole_model`);
this module runs it on the model the pipeline loaded, writes the checkpoint into the pipeline's partial OUT and
checks it; the pipeline writes the report, as for every run.
This is the exception to "the decoder layer is the unit of work" (STYLE 14): there is no layer to be the
unit, so memory follows the model. One info line says so. Everything else refuses in one line (exit 2,
before loading), naming what is missing and what still works: a streamed run (nothing to read one layer at a
time), GPTQ/AWQ/Wanda/SparseGPT (each decoder layer's inputs; AWQ and SmoothQuant also the norm → linear
feeds they fold scales into), distillation.

OUT is written with the formats' public pieces (`pack_gptq`, `pack_ct`, the quantization configs, the sparse
bitmask's tensors), in the same formats the layer walk writes, and checked the same way: loaded back by our
loader and its logits compared with the in-process model's on the probe windows (`verify.compare`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from geminicompress.engine.contract import StageContext
from geminicompress.engine.verify import as_stored, compare, loaded_logits, model_logits, probe_windows, stored_dtype
from geminicompress.formats.checkpoint import WEIGHTS, write_config
from geminicompress.runtime.methods import method_of


def run_whole_model(ctx: StageContext, stage: Any, tmp: Path, verify: bool = True) -> tuple[float, dict, dict]:
    """`stage` on the whole model in memory (`ctx.model`), its checkpoint written into `tmp` and, with `verify`,
    loaded back and compared; returns (the pass's seconds, its summary, the export's record)."""
    model = ctx.model
    method = method_of(stage)
    ctx.progress.info(f"'{getattr(model.config, 'model_type', '?')}': no decoder layers found; "
                      f"{method.whole_model_label or method.name} runs on the whole model in memory")
    t0 = time.perf_counter()
    written = method.whole_model(model, stage, ctx.out_dtype, ctx.progress)
    seconds = time.perf_counter() - t0
    windows = probe_windows(ctx.tokenizer, model.config.vocab_size)
    reference = None
    if verify:  # the in-process model as stored, before it is freed
        as_stored(model, ctx.out_dtype, written.exact)
        reference = model_logits(model, windows)
    tensors = written.tensors()
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    del tensors
    write_config(model, tmp, written.qconfig, ctx.out_dtype)
    if written.extra is not None:
        written.extra(tmp, written.qconfig)
    if ctx.tokenizer is not None:
        ctx.tokenizer.save_pretrained(tmp)
    export: dict[str, Any] = {"format": written.format, "whole_model": True, "dtype": ctx.recipe.output.dtype,
                              "seconds": round(seconds, 3), "device": "cpu"}
    if reference is not None:
        ctx.progress.info("verifying: loading OUT back in memory")
        got = loaded_logits(tmp, windows, ctx.recipe.trust_remote_code, streamed=False)
        export["verified"] = compare(reference, got, stored_dtype(tmp), "in-memory")
    return seconds, written.summary, export
