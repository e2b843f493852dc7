"""What a stage type is to a run: one class per method (`compress/<method>/method.py`), one for distill
(`distill/method.py`) and one for eval (`eval/method.py`); the registry (`runtime/methods.py`) is the list of
them. The run asks the class: which config it reads, whether a config calibrates or streams, what it checks on
the model's skeleton before any weight is read, its layer stage, what it does on a model without decoder
layers, its formats and its help line. Nobody else writes `if cfg.method == "gptq"`.

Every member is a class attribute or a classmethod: a method is a kind of stage, not a run of one (a run of
one is its layer stage, `LayerStage`, or its `run(cfg, ctx)`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel

from geminicompress.engine.contract import LayerStage, StageContext


class Method:
    """A stage type of a recipe. Subclass it, set the attributes, override what differs from the default."""

    name: ClassVar[str]  # "gptq", "prune", "distill", "eval": the recipe's `method:` (quantize) or `type:`
    type: ClassVar[str]  # the recipe's `type:` ("quantize", "prune", "distill", "eval")
    config: ClassVar[type[BaseModel]]  # its pydantic stage config
    help: ClassVar[str]  # one line, shown by `--help`
    kind: ClassVar[str] = "layers"  # layers: a layer stage the engine runs; model: run(cfg, ctx) on the model in
    # memory (distill); eval: run(cfg, ctx) after OUT is written, loading it back
    default_format: ClassVar[str | None] = None  # the format it writes unless `format:` says (None: the model's)
    quantizes: ClassVar[bool] = False  # its OUT holds quantized weights (smaller than float: the disk estimate)
    # what a model without decoder layers does not give it ("": it runs on the whole model in memory)
    needs: ClassVar[str] = "decoder layers"
    whole_model_label: ClassVar[str | None] = None  # what the whole-model info line calls it (default: name)
    stage_class: ClassVar[type[LayerStage] | None] = None  # its layer stage (kind "layers"): opened by `stage`,
    # asked by `cannot_stream`
    calibrated: ClassVar[bool] = False  # every config of it reads calibration text (else: `calibrates` decides)
    label: ClassVar[str | None] = None  # its progress bar's label (default: name)

    @classmethod
    def tag(cls) -> str:
        """The key of its config in the recipe schema's union (`schema.stage_tag`)."""
        return f"{cls.type}:{cls.name}" if cls.type == "quantize" else cls.type

    @classmethod
    def calibrates(cls, cfg: Any) -> bool:
        """Whether a config of it reads calibration text."""
        return cls.calibrated

    @classmethod
    def cannot_stream(cls, cfg: Any, first: bool) -> str | None:
        """Why a config of it cannot run one decoder layer at a time from disk (None: it can). `first`: it is
        the recipe's first stage."""
        return cls.stage_class.cannot_stream(cfg, first) if cls.stage_class is not None else None

    @classmethod
    def preflight(cls, cfg: Any, skeleton: Any, arch: Any) -> Any:
        """An InputError for what the model's skeleton (config.json on the meta device) already refuses; else
        what it resolved there for its stage to open with (the run's plan, `contract.Plan`), or None."""

    @classmethod
    def check_config(cls, cfg: Any, config: dict[str, Any]) -> None:
        """An InputError for what the model's config.json alone refuses (no skeleton built)."""

    @classmethod
    def before_load(cls, cfg: Any, model: str) -> None:
        """An InputError, before MODEL loads (asked when the run is planned), for what a config of it cannot do
        with MODEL."""

    @classmethod
    def stage(cls, cfg: Any, ctx: StageContext) -> LayerStage:
        """Its layer stage, opened: bad input fails here, before any work (kind "layers")."""
        if cls.stage_class is None:
            raise NotImplementedError(f"{cls.tag()} is not a layer stage")
        return cls.stage_class(cfg, ctx)

    @classmethod
    def run(cls, cfg: Any, ctx: StageContext) -> dict[str, Any]:
        """A model or eval stage on the run's model (kind "model" or "eval"): its summary."""
        raise NotImplementedError(f"{cls.tag()} is a layer stage")

    @classmethod
    def describe(cls, cfg: Any) -> str:
        """Its progress bar's label."""
        return cls.label or cls.name

    @classmethod
    def needs_layers(cls, cfg: Any, where: str) -> str | None:
        """Why a config of it cannot run on a model without decoder layers because of what it reads there
        (`where`: "MODEL x ('type') has no decoder layers"); None: its `whole_model` may run it."""
        return f"{cls.tag().replace(':', ' ')}: {where}, and it needs {cls.needs}" if cls.needs else None

    @classmethod
    def whole_model_refusal(cls, cfg: Any, where: str) -> str | None:
        """Why the whole-model pass refuses a config that `needs_layers` let through (a format, a scope)."""
        return None

    @classmethod
    def whole_model(cls, model: Any, cfg: Any, dtype: Any, progress: Any) -> Any:
        """It on the whole model in memory (no decoder layers): what OUT holds (`engine.whole.Written`)."""
        raise NotImplementedError(f"{cls.tag()} needs decoder layers")

    @classmethod
    def streamed_input(cls, cfg: Any, recipe: Any, progress: Any) -> Any:
        """As the recipe's first stage: the input the run hands it when it reads the model itself, layer by
        layer (distill's streamed teacher), else None: the run loads the model."""
        return None
