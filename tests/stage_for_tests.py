"""Model stages (run(cfg, ctx) -> dict) used only by the foundation tests: the pipeline tested without a real stage."""

import torch


def zero_first_layer(cfg, ctx):
    """Zero layer 0's q_proj: a visible, checkable change."""
    with torch.no_grad():
        ctx.model.model.layers[0].self_attn.q_proj.weight.zero_()
    return {"zeroed": "model.layers.0.self_attn.q_proj"}


def explode(cfg, ctx):
    (ctx.out_dir / "half-written.bin").write_bytes(b"x")
    raise RuntimeError("stage failed halfway")


def model_stage(fn):
    """A registry entry that runs `fn(cfg, ctx)` on the model in memory, in place of a real stage type."""
    from geminicompress.engine.method import Method

    class ModelStage(Method):
        name = type = fn.__name__
        kind = "model"
        needs = ""

        @classmethod
        def run(cls, cfg, ctx):
            return fn(cfg, ctx)

    return ModelStage
