"""How a frozen teacher is held while a student trains under autocast (bf16 or fp16): in fewer resident bytes,
computing the same products.

- Its linears' weights in the autocast dtype (`frozen_linears_as`): autocast casts a float32 weight to that dtype
  for every product anyway, so the products are the same, in half the bytes (Gemma 3 270M's decoder: 0.19 GiB).
- Its input embedding table left in the checkpoint file (`table_in_file`): a lookup reads only its batch's rows, so
  where the table is a view of the file's mapping whose pages nothing wrote, the table becomes a read-only shared
  mapping of the same bytes, whose pages leave the resident set after every lookup (the file's bytes stay in the
  page cache, as llama.cpp's mmap'd weights do). A head tied to the table gets its own copy in the autocast dtype,
  the copy the chunked head made at every step (distill/chunked_head.weight_as). Gemma 3 270M: its 0.63 GiB
  float32 table out of the resident set, a 0.31 GiB bf16 head in (and no longer made per step).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from geminicompress.host.memory import drop_pages, file_region, file_view, release_weights


def frozen_linears_as(model: nn.Module, dtype: torch.dtype, keep: Iterable[torch.Tensor] = ()) -> int:
    """Hold the weights of a frozen `model`'s nn.Linear modules in `dtype`, in place, for a model that only runs
    under autocast to `dtype`: autocast casts a float32 weight to `dtype` for every product, so the products are
    the same and the weights take half the bytes (the distillation teacher's decoder: 0.19 GiB of Gemma 3 270M's).
    A weight that is also another module's (a head tied to the embedding, whose lookup autocast does not cast)
    or among `keep` (shared with a model that trains) stays as it is. The float32 weights are released at once,
    their pages too where they are views of the checkpoint file's mapping (host/memory.release_weights). Returns
    the bytes saved."""
    kept = {t.data_ptr() for t in keep}
    others = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight.dtype != dtype
             and m.weight.is_floating_point() and id(m.weight) not in others and m.weight.data_ptr() not in kept]
    held = {name: model.get_submodule(name).weight.detach().to(dtype) for name in names}
    saved = release_weights(model, names)  # one read of the process's mappings for them all
    for name, weight in held.items():
        model.get_submodule(name).weight = nn.Parameter(weight, requires_grad=False)
        saved -= weight.untyped_storage().nbytes()
    return saved


def table_in_file(model: nn.Module, dtype: torch.dtype, keep: Iterable[torch.Tensor] = ()) -> int:
    """Leave the frozen `model`'s input embedding table in its checkpoint file (module docstring), its tied head
    copied in `dtype`; nothing done where the table is not an unwritten view of a file or is among `keep`.
    Returns the resident bytes saved (the table's, less the head's copy)."""
    emb = model.get_input_embeddings()
    table = emb.weight if isinstance(emb, nn.Embedding) else None
    if table is None or table.data_ptr() in {t.data_ptr() for t in keep}:
        return 0
    region = file_region(table)
    if region is None:
        return 0
    head, saved = model.get_output_embeddings(), table.numel() * table.element_size()
    if head is not None and head.weight is table:  # tied: the head's products read every row, in `dtype`
        head.weight = nn.Parameter(table.detach().to(dtype), requires_grad=False)
        saved -= head.weight.numel() * head.weight.element_size()
    view = file_view(*region, table)
    name = next(n for n, m in model.named_modules() if m is emb)
    release_weights(model, [name])  # the private mapping's pages of the table, out of the resident set
    emb.weight = nn.Parameter(view, requires_grad=False)
    emb.register_forward_hook(lambda module, args, out: drop_pages(module.weight))
    return saved
