"""The check of OUT for a streamed run (geminicompress/verify.py says what is compared and why).

There is no whole model in memory, so the probe windows (2 x 64 seeded token ids) are carried through
the in-process result as it is made: layer 0's inputs captured from the input checkpoint's embeddings
before the first layer is read; each finished layer, in the state it is written in, runs the probe
(`VerifyingSink.finish`, before the layer is handed to the shard writer and dropped); then the final
norm and head (the INT8 head when the run quantizes it). Everything is taken as stored: float tensors
rounded to the output dtype, the weights a format stores as codes set to their exact dequantized values
(from the codes the stage kept, not from what was packed). Memory: the probe's (2, 64, hidden) activations.

OUT is read back one layer at a time too (never loaded whole: that would raise the run's memory with its
depth). A resumed run's finished layers were made by an earlier process, which did not carry the probe: the
check is then skipped, and the record says so.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from geminicompress.compress.arch import get_module
from geminicompress.engine.layers import computing_in
from geminicompress.errors import GeminiError
from geminicompress.models.forward import embed, head_logits, through_layer
from geminicompress.models.lazy import LazyCheckpoint, LazyLayers
from geminicompress.progress import NullProgress, Progress
from geminicompress.streaming.sink import ShardSink
from geminicompress.verify import as_stored, compare, final_name, loaded_logits, probe_windows, stored_dtype

# (layer, kept) -> {module: a function that makes its weight}: made one module at a time, as the probe sets them
ExactWeights = Callable[[int, dict[str, torch.Tensor]], dict[str, Callable[[], torch.Tensor]]]
HeadModule = Callable[[str, nn.Module], nn.Module]  # what the run writes for an outside module (the INT8 head)


class StreamedProbe:
    """The probe windows carried through a streamed run's finished layers, then checked against OUT."""

    def __init__(self, ckpt: LazyCheckpoint, tokenizer: Any, out_dtype: torch.dtype, device: torch.device) -> None:
        self.ckpt, self.out_dtype, self.device = ckpt, out_dtype, device
        self.windows = probe_windows(tokenizer, ckpt.model.config.vocab_size)
        self.hidden = embed(LazyLayers(ckpt), self.windows, device=device, stored=out_dtype)  # (n, T, d) float32
        self.resumed: list[int] = []

    @torch.no_grad()
    def advance(self, layer: nn.Module, exact: dict[str, Callable[[], torch.Tensor]]) -> None:
        """Run the probe through a finished layer as it is stored: floats rounded to the output dtype, the
        linears `exact` names ({name relative to the layer: a function making its weight}) with those weights,
        made one at a time (each replaces the module's own weight, so one extra weight is alive at most: all
        of an 8B layer's at once were +0.87 GB, the streamed GPTQ run's peak)."""
        with computing_in(layer, torch.float32):  # float32 copies of a lower-precision layer, put back after
            as_stored(layer, self.out_dtype, [f"{n}.weight" for n in exact])
            for name, make in exact.items():
                get_module(layer, name).weight.data = make().to(self.device, torch.float32)
            through_layer(layer, self.hidden.tensor, self.hidden.tensor, self.hidden.kwargs, device=self.device,
                          dtype=torch.float32, batch=1)  # one window at a time, as the loaded side

    def check(self, out: Path, head: HeadModule | None, state: Path, *, trust_remote_code: bool = False,
              progress: Progress | None = None) -> dict[str, Any]:
        """The head over the carried activations, then OUT loaded back and compared (verify.compare). On a
        failure the run's resume state (`state`) goes too: its finished layers are what was written wrong,
        and a rerun resuming from them would skip the check."""
        progress = progress or NullProgress()
        try:
            if self.resumed:
                return {"windows": list(self.windows.shape), "skipped": f"the run resumed: layers {self.resumed[0]}-"
                        f"{self.resumed[-1]} were finished by an earlier process, which did not carry the probe"}
            t0 = time.perf_counter()

            def as_written(name: str, module: nn.Module) -> nn.Module:
                module = head(name, module) if head is not None else module
                as_stored(module, self.out_dtype)
                return module

            parts = dict(head_logits(LazyLayers(self.ckpt), self.hidden, device=self.device, transform=as_written))
            reference = torch.cat([parts[k] for k in sorted(parts)])
            # read back one layer at a time, as it was made: loaded whole, OUT took more memory than the run
            # (8B-shaped GPTQ, 8 layers: 5.44 GiB peak, against 3.95 GiB for the layers themselves)
            progress.info(f"verifying {final_name(out)}: loading it back one layer at a time")
            got = loaded_logits(out, self.windows, trust_remote_code, streamed=True, device=self.device)
            try:
                return compare(reference, got, stored_dtype(out), "streamed", seconds=time.perf_counter() - t0)
            except GeminiError:
                shutil.rmtree(state, ignore_errors=True)
                raise
        finally:
            self.hidden.close()


class VerifyingSink(ShardSink):
    """A `ShardSink` that runs the probe through each finished layer before writing it."""

    def __init__(self, writer: Any, tensors_of: Any, load_back: Any, probe: StreamedProbe,
                 exact: ExactWeights) -> None:
        super().__init__(writer, tensors_of, load_back)
        self.probe, self.exact = probe, exact

    def restore(self, i: int, layer: nn.Module | None) -> tuple[dict, dict[str, torch.Tensor]]:
        self.probe.resumed.append(i)
        return super().restore(i, layer)

    def finish(self, i: int, layer: nn.Module, summary: dict, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # the probe first: rounding a float32 layer to the output dtype in place changes nothing it writes
        # (the writer casts to that dtype; packed linears are written from the kept codes)
        prefix = self.probe.ckpt.layer_prefix(i) + "."
        self.probe.advance(layer, {k.removeprefix(prefix): v for k, v in self.exact(i, kept).items()})
        return super().finish(i, layer, summary, kept)


def exact_weights(output: Any, owner: int | None, n: int) -> ExactWeights:
    """{module: weight} of layer i's linears that the output stores as integer codes (a b-bit format),
    dequantized from the codes the stage kept; none for other outputs (their float tensors are rounded)."""
    from geminicompress.streaming.output import PackedOutput
    from geminicompress.streaming.stage import stage_kept

    if not isinstance(output, PackedOutput):
        return lambda i, kept: {}

    def exact(i: int, kept: dict[str, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
        qweights = output.qweights(i, stage_kept(kept, owner, n))  # a lazy mapping: unpacked when read
        return {name: (lambda name=name: qweights[name].dequantize()) for name in qweights}
    return exact


def written_head(int8: Any) -> HeadModule | None:
    """The module the run writes for an outside module: the INT8 one when the int8 stage quantizes it."""
    if int8 is None:
        return None

    def module(name: str, read: nn.Module) -> nn.Module:
        rows = int8.quantize(read, name) if name in int8.targets else []
        return rows[0]["module"] if rows else read

    return module
