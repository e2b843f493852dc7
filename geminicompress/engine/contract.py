"""The stage contract: what a stage sees of a run (`StageContext`) and what a layer stage gives the engine
(`LayerStage`). It lives below the stages and the orchestrator (pipeline.py), so neither imports the other.

A *layer stage* (every quantize method, prune) is made once per run by its method class
(`engine/method.py: Method.stage(cfg, ctx) -> LayerStage`), which opens the stage the same way in memory and streamed:
which linears, the spec, the format's shape checks, and any whole-model decision taken as a *pre-pass*
that produces per-layer parameters (global magnitude threshold, allocations). The engine then applies
its `layer_fn` to every decoder layer (walk.py), hands each finished layer to a sink, and asks for the
stage's `summary` once every layer is done. A *model stage* (distill) and the eval stage are functions
`run(cfg, ctx) -> dict` on the model in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from geminicompress.core.arch import arch_for
from geminicompress.data.windows import calibration_windows, vocab_of
from geminicompress.engine.layers import LayerFn
from geminicompress.formats.writer import LayerWriter
from geminicompress.host.progress import Progress


@dataclass
class Plan:
    """What the run resolved for its stages before any weight was read (runtime/plan.py): for each stage
    config (the recipe's own object), what its method's `preflight` found on the model's skeleton, e.g. a b-bit
    stage's targets with group size "auto" made a number and the format's shapes checked. A stage opens with
    its entry instead of resolving again; one with none (no local config.json, a model handed in) resolves
    when it opens."""

    found: list[tuple[Any, Any]] = field(default_factory=list)  # (stage config, what preflight found for it)

    def record(self, cfg: Any, found: Any) -> None:
        if found is not None:
            self.found.append((cfg, found))

    def of(self, cfg: Any) -> Any:
        """What preflight found for `cfg` (this very object), or None."""
        return next((found for c, found in self.found if c is cfg), None)


@dataclass
class StageContext:
    """What a stage can see and change. `model`/`tokenizer` flow from stage to stage.

    model: the model in memory, or for a streamed run the checkpoint's skeleton (parameters on the meta
    device: `models.lazy.LazyCheckpoint`), whose layers the engine reads one at a time (`layers`)."""

    model: Any
    tokenizer: Any
    source: Any  # models.loading.ModelSource
    recipe: Any  # recipes.schema.Recipe
    progress: Progress
    device: torch.device
    out_dir: Path  # the (partial) output folder; stages may add artifacts next to the weights
    state_dir: Path  # this stage's private folder for resumable state; removed on success
    masks: dict[str, torch.Tensor] | None = None  # set by prune, honoured by distill
    layers: Any = None  # the run's layer source (engine.walk.ModelLayers or models.lazy.LazyLayers)
    out_dtype: torch.dtype = torch.float32  # the float dtype OUT's tensors are written in
    source_dtype: torch.dtype = torch.float32  # the float dtype the layers are stored in (a model in memory: float32)
    streamed: bool = False
    input_nonfinite: list[dict] | None = None  # NaN/Inf tensors of the input that allow_nonfinite let through
    plan: Plan = field(default_factory=Plan)  # what preflight resolved for the stages (empty: nothing was planned)
    _calibration: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def calibration(self, data: str | None = None, samples: int | None = None, seq_len: int | None = None) -> torch.Tensor:
        """Seeded calibration windows (n, seq_len) from the stage's DATA or the recipe's default, framed as the
        recipe says (the tokenizer's BOS first, by default: data/windows.py)."""
        cal = self.recipe.calibration
        key = (data or cal.data, samples or cal.samples, seq_len or cal.seq_len, self.recipe.seed)
        if key not in self._calibration:
            self._calibration[key] = calibration_windows(self.tokenizer, key[0], key[1], key[2], key[3], cal.text_column,
                                                         self.recipe.frame, vocab_of(self.model))
        return self._calibration[key]

    def layer_prefix(self, i: int) -> str:
        return f"{arch_for(self.model).layers}.{i}"


@dataclass
class Done:
    """What a layer stage's summary may read once every layer is finished."""

    out_dir: Path
    progress: Progress
    windows: torch.Tensor | None = None  # the walk's calibration windows (n, T), for calibrated stages
    calibration_data: str = ""  # the recipe's calibration DATA (a stage's own `data` wins)
    outside_rows: list[dict] = field(default_factory=list)  # what `outside` did to the modules outside the layers
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # the stage's kept tensors the sink retained
    calib_dtype: torch.dtype | None = None  # the dtype the layers computed in while calibrating


class LayerStage:
    """A method, as the engine runs it: subclass this. `layer_fn`, `writer` and `summary` are the contract;
    the other members are optional hooks whose defaults here do nothing, so the engine never probes for them.

    `outside(name, module) -> (module, row) | None`: the modules outside the decoder layers (an INT8 head);
    `outside_names()`: the modules it may change.
    `retain(kept) -> kept` (with `retains = True`): which kept tensors a streamed run must hold until the
    summary (AWQ's search results). `cannot_stream(cfg, first)`: why a config cannot run streamed, or None."""

    cfg: Any
    calibrated: bool = False  # needs the layer's inputs on calibration windows
    dtypes: tuple[torch.dtype, torch.dtype] | None = None  # (compute, hold) while calibrating; None: the walk's
    squares: int = 0  # float32 (in)^2 buffers at its peak (estimate.py)
    one_pass_memory: bool = False  # holds a layer's activations for every window (estimate.py)
    rounds_floats: bool = False  # changes float weights that a lower output dtype rounds (resume: pipeline.py)
    resume_from_input: bool = False  # the next layer's inputs are the float layer's outputs (engine/export.py load_back_of)
    retains: bool = False  # has a `retain` that keeps tensors until the summary
    quantizes: bool = False  # OUT holds its weights quantized (smaller than float: estimate.py)

    @staticmethod
    def cannot_stream(cfg: Any, first: bool) -> str | None:
        return None

    def layer_fn(self) -> LayerFn:
        raise NotImplementedError

    def writer(self) -> LayerWriter | None:  # the format it writes (None: it leaves the previous one's)
        return None

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]:
        raise NotImplementedError

    def outside(self, name: str, module: Any) -> tuple[Any, dict] | None:
        return None

    def outside_names(self) -> set[str]:
        """The modules outside the layers that `outside` may change (the check makes those from float32)."""
        return set()

    def retain(self, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {}


def walk_dtypes(stages: list[LayerStage]) -> tuple[torch.dtype, torch.dtype] | None:
    """(dtype the layers compute in, dtype they are held in) while a walk calibrates; None: none calibrates.
    One calibrated stage may choose (GPTQ on a bfloat16 checkpoint: its `dtypes`); with several on one
    layer it computes in float32, since the stages write the weights it computes with."""
    mine = [s for s in stages if s.calibrated]
    if not mine:
        return None
    if len(mine) == 1 and mine[0].dtypes is not None:
        return mine[0].dtypes
    return torch.float32, torch.float32


def stage_kept(kept: dict[str, torch.Tensor], k: int, n: int) -> dict[str, torch.Tensor]:
    """Stage k's own kept tensors (or summary entries) of a composed LayerFn over n stages."""
    return kept if n == 1 else layer_kept(kept, k)


def layer_kept(kept: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer i's entries of a walk's kept tensors ("<i>.<name>" -> "<name>")."""
    head = f"{i}."
    return {key[len(head):]: v for key, v in kept.items() if key.startswith(head)}
