"""A decoder model's structure found by looking at it: what `arch.py` used to hard-code per `model_type`.

llm-compressor's way (`_no_split_modules`, sequential targets found from the model), plus one traced forward:
- the decoder layers: the `ModuleList` of the blocks `_no_split_modules` names (the longest one), else the
  longest `ModuleList` of one block class holding linears;
- the linears of one layer in execution order, grouped by the input they share: one forward of a *copy* of
  layer 0 (random weights from a fixed seed, built from the model's config, so a lazy skeleton on the meta
  device or a model already quantized traces the same as the float model) on a few positions, with hooks
  that record each module's call order, its input tensor and its output tensor (linears reading the same
  tensor object form one group);
- the norm -> linears feeds AWQ and SmoothQuant fold scales across: a module whose output tensor *is* the
  group's input (the same object). A group fed by no module is tried against each earlier linear A: scale
  A's output channels by random s > 0 and run the layer again; when the group's input changes by a fixed
  factor per channel (v_proj -> o_proj through attention, up_proj -> down_proj through act(gate) * up), A
  feeds it (what llm-awq writes by hand per architecture);
- `norm_offset`: the feeding norms' behaviour with a zero weight (y = x̂·(offset + w): Gemma's 1 + w norms
  give x̂, the others 0);
- the final norm: the module beside the layers holding a per-channel weight of the hidden size.

Pure plumbing: imports nothing of the package but its errors, so it can sit on the ground floor.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from geminicompress.core.errors import InputError

TRACE_TOKENS = 8
_SMALL = 1 << 22  # parameters materialised outside the layers, at most (elements)
_SEED = 0


class _Stop(Exception):
    pass


@dataclass(frozen=True)
class Traced:
    """What the trace found (names relative to the CausalLM for `layers`/`final_norm`, else to a layer)."""

    layers: str
    sequential: tuple[tuple[str, ...], ...]
    feeds: tuple[tuple[str, tuple[str, ...], str], ...]  # (prev, linears, inspect) per foldable group
    unfed: tuple[tuple[str, ...], ...]  # groups whose input no norm or linear produces (nothing to fold into)
    norm_offset: float
    final_norm: str
    output_tuple: int  # 0: a layer returns its hidden states; k: a tuple of k items, the hidden states first


def find_layers(model: nn.Module) -> str:
    """Path of the decoder layers' ModuleList: the longest list of `_no_split_modules` blocks, else the
    longest list of one block class that holds linears."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0
             and len({type(c) for c in m}) == 1]
    named = [(n, m) for n, m in lists if type(m[0]).__name__ in blocks]
    found = named or [(n, m) for n, m in lists if any(isinstance(x, nn.Linear) for x in m[0].modules())]
    if not found:
        raise InputError(f"architecture '{getattr(model.config, 'model_type', '?')}': no decoder layers found "
                         "(no list of repeated blocks holding linear layers)")
    return max(found, key=lambda nm: len(nm[1]))[0]


def _final_norm(model: nn.Module, layers_path: str) -> str:
    parent_path = layers_path.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    hidden = model.config.hidden_size
    found = [name for name, child in parent.named_children()
             if isinstance(getattr(child, "weight", None), torch.Tensor) and child.weight.dim() == 1
             and child.weight.shape[0] == hidden]
    # a norm without parameters (OLMo's): by its class name
    found = found or [name for name, child in parent.named_children() if "norm" in type(child).__name__.lower()]
    if not found:
        return ""
    return f"{parent_path}.{found[-1]}" if parent_path else found[-1]


def _skeleton(model: nn.Module) -> nn.Module:
    """The model's class built from its config with parameters on the meta device (buffers real)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        skeleton = type(model)(copy.deepcopy(model.config))
    # small modules a forward runs before the layers (learned positions, an embedding norm) get zeros; the
    # token embeddings are never run (the trace feeds embeddings) and stay on meta
    embeddings = skeleton.get_input_embeddings()
    for module in skeleton.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta and module is not embeddings and p.numel() <= _SMALL:
                module._parameters[name] = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=False)
    return skeleton.eval()


def _layer_kwargs(skeleton: nn.Module, layers: nn.ModuleList) -> dict[str, Any]:
    """The keyword arguments the model hands decoder layer 0 (from a forward on zero embeddings)."""
    captured: dict[str, Any] = {}

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.update(kwargs)
        captured["_args"] = args
        raise _Stop

    handle = layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    embeds = torch.zeros(1, TRACE_TOKENS, skeleton.config.hidden_size)
    try:
        with torch.no_grad():
            skeleton(inputs_embeds=embeds, use_cache=False)
    except _Stop:
        pass
    except Exception as exc:  # a forward we cannot drive: say so in one line
        raise InputError(f"architecture '{skeleton.config.model_type}': its structure cannot be traced "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    finally:
        handle.remove()
    if "_args" not in captured:
        raise InputError(f"architecture '{skeleton.config.model_type}': its forward never reaches its decoder layers")
    args = captured.pop("_args")
    for key in ("cache", "past_key_values", "past_key_value", "use_cache", "hidden_states"):
        captured.pop(key, None)
    if len(args) > 1:
        raise InputError(f"architecture '{skeleton.config.model_type}': its decoder layers take positional "
                         "arguments besides the hidden states; add an override row in core/arch.py")
    return captured


def _random_layer(layer: nn.Module) -> nn.Module:
    """A copy of `layer` with seeded random weights (linears ~ 1/sqrt(in), per-channel weights ~ 1)."""
    gen = torch.Generator().manual_seed(_SEED)
    out = copy.deepcopy(layer)
    for module in out.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if p.dim() >= 2:
                value = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            elif name == "bias":
                value = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            module._parameters[name] = nn.Parameter(value.float(), requires_grad=False)
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)
    return out.float().eval()


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    if isinstance(value, torch.Tensor):
        return value
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def _output_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _run(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any], scale: tuple[nn.Module, torch.Tensor] | None = None,
         record: bool = True) -> tuple[list[tuple[str, nn.Module, torch.Tensor | None, torch.Tensor | None]], Any]:
    """One forward of `layer`; the calls (name, module, input, output) in order. `scale`: (module, s) multiplies
    that module's output channels by s."""
    calls: list[tuple[str, nn.Module, torch.Tensor | None, torch.Tensor | None]] = []
    handles = []
    for name, module in layer.named_modules():
        if not name:
            continue

        def hook(m: nn.Module, args: tuple, kwargs: dict, out: Any, name: str = name) -> Any:
            if scale is not None and m is scale[0]:
                out = out * scale[1]
            if record:
                calls.append((name, m, _first_tensor(args, kwargs), _output_tensor(out)))
            return out if scale is not None and m is scale[0] else None

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            out = layer(hidden, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls, out


def _common_parent(names: tuple[str, ...], keep_single: bool) -> str:
    """The closest module containing all `names` (for one name: itself when `keep_single`, else its parent)."""
    if len(names) == 1 and keep_single:
        return names[0]
    parts = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _foldable(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1


def _homogeneous(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether `after` = `before` times a fixed positive factor per channel (last dim), not all 1."""
    x, y = before.reshape(-1, before.shape[-1]), after.reshape(-1, after.shape[-1])
    big = x.abs() > 1e-4 * x.abs().max()
    seen = big.any(0)  # channels with a value to compare (a ReLU may zero a channel at every position)
    if float(seen.float().mean()) < 0.5:
        return False
    x, y, big = x[:, seen], y[:, seen], big[:, seen]
    ratio = torch.where(big, y / torch.where(big, x, torch.ones_like(x)), torch.nan)
    hi, lo = ratio.nan_to_num(-torch.inf).amax(0), ratio.nan_to_num(torch.inf).amin(0)
    unseen_changed = bool((y[~big] - x[~big]).abs().max() > 1e-4 * x.abs().max()) if bool((~big).any()) else False
    return (bool((lo > 0).all() and ((hi - lo) <= 1e-3 * hi).all() and ((hi - 1).abs() > 1e-2).any())
        and not unseen_changed)


def _norm_offset(norm: nn.Module, width: int) -> float:
    """offset where the norm computes x̂·(offset + w): its output with w = 0 over its output with w = 1 minus it."""
    probe = copy.deepcopy(norm).float()
    x = torch.randn(2, TRACE_TOKENS, width, generator=torch.Generator().manual_seed(_SEED))
    outs = []
    with torch.no_grad():
        for w in (0.0, 1.0):
            probe.weight.fill_(w)
            if isinstance(getattr(probe, "bias", None), torch.Tensor):
                probe.bias.zero_()
            outs.append(_output_tensor(probe(x)))
    y0, y1 = outs
    if y0 is None or y1 is None:
        return 0.0
    diff = y1 - y0
    big = diff.abs() > 1e-3 * diff.abs().max()
    if not bool(big.any()):
        return 0.0
    return round(float((y0[big] / diff[big]).median()), 3)


def trace(model: nn.Module) -> Traced:
    """The structure of `model` (any state: in memory, a meta skeleton, already quantized): see the module doc."""
    layers_path = find_layers(model)
    skeleton = _skeleton(model)
    layers = skeleton.get_submodule(layers_path)
    kwargs = _layer_kwargs(skeleton, layers)
    layer = _random_layer(layers[0])
    kwargs = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else
                  tuple(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in v)
                  if isinstance(v, tuple) else v) for k, v in kwargs.items()}
    hidden = torch.randn(1, TRACE_TOKENS, skeleton.config.hidden_size, generator=torch.Generator().manual_seed(_SEED))
    calls, out = _run(layer, hidden, kwargs)
    output_tuple = len(out) if isinstance(out, tuple) else 0

    linear_calls: dict[str, tuple[nn.Module, torch.Tensor]] = {}
    for name, module, x, _ in calls:
        if isinstance(module, nn.Linear) and name not in linear_calls and x is not None:
            linear_calls[name] = (module, x)
    groups: dict[int, list[str]] = {}
    for name, (_, x) in linear_calls.items():
        groups.setdefault(id(x), []).append(name)
    sequential = tuple(tuple(g) for g in groups.values())
    if not sequential:
        raise InputError(f"architecture '{model.config.model_type}': its decoder layers run no linear layers")

    producers: dict[int, str] = {}  # tensor id -> the first foldable module that output it
    modules = dict(layer.named_modules())
    for name, module, _, y in calls:
        if y is not None and id(y) not in producers and _foldable(module):
            producers[id(y)] = name
    feeds: list[tuple[str, tuple[str, ...], str]] = []
    unfed: list[tuple[str, ...]] = []
    norms: list[tuple[nn.Module, int]] = []
    order = list(linear_calls)
    for g, group in enumerate(sequential):
        x = linear_calls[group[0]][1]
        prev = producers.get(id(x))
        if prev is not None and prev not in group:
            keep_single = isinstance(modules[prev], nn.Linear)
            feeds.append((prev, group, _common_parent(group, keep_single)))
            if not isinstance(modules[prev], nn.Linear):
                norms.append((modules[prev], x.shape[-1]))
            continue
        prev = _linear_feed(layer, hidden, kwargs, group, order, linear_calls)
        if prev is not None:
            feeds.append((prev, group, _common_parent(group, True)))
        else:
            unfed.append(group)
    offsets = {_norm_offset(n, w) for n, w in norms}
    if len(offsets) > 1:
        raise InputError(f"architecture '{model.config.model_type}': its norms compute differently "
                         f"(offsets {sorted(offsets)}); add an override row in core/arch.py")
    return Traced(layers_path, sequential, tuple(feeds), tuple(unfed), offsets.pop() if offsets else 0.0,
                  _final_norm(model, layers_path), output_tuple)


def _linear_feed(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any], group: tuple[str, ...],
                 order: list[str], linear_calls: dict[str, tuple[nn.Module, torch.Tensor]]) -> str | None:
    """The last linear before `group` whose output channels, scaled by s > 0, scale the group's input by a
    fixed factor per channel (so 1/s folds into that linear's rows and s into the group's columns)."""
    target = linear_calls[group[0]][0]
    before = linear_calls[group[0]][1]
    earlier = order[:order.index(group[0])]
    for name in reversed(earlier):
        if name in group:
            continue
        module = linear_calls[name][0]
        s = 0.5 + 1.5 * torch.rand(module.out_features, generator=torch.Generator().manual_seed(_SEED + 1))
        seen: list[torch.Tensor] = []
        handle = target.register_forward_pre_hook(lambda m, a: seen.append(a[0]) if not seen else None)
        try:
            _run(layer, hidden, kwargs, scale=(module, s), record=False)
        finally:
            handle.remove()
        if seen and seen[0].shape == before.shape and _homogeneous(before, seen[0]):
            return name
    return None
