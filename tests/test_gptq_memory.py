"""The GPTQ solver's low-memory path (overwrite=True: H and W used as scratch, two Hessian-sized buffers
at most) gives exactly the codes of the copying path, for every ordering option."""

from __future__ import annotations

import pytest
import torch

from geminicompress.compress.gptq.solver import gptq_quantize
from geminicompress.compress.grid import QuantSpec


@pytest.mark.parametrize("group_size,act_order,static", [(32, True, False), (-1, False, False), (64, True, True),
                                                          (128, False, True)])
def test_overwrite_gives_the_same_codes(group_size, act_order, static):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(24, 128, generator=g)
    X = torch.randn(400, 128, generator=g) * torch.rand(128, generator=g) * 3
    X[:, 5] = 0  # a dead input
    H = 2 * X.t() @ X / 400
    spec = QuantSpec(4, group_size, True)
    ref, loss = gptq_quantize(W, H, spec, act_order=act_order, static_groups=static)
    W2, H2 = W.clone(), H.clone()
    got, loss2 = gptq_quantize(W2, H2, spec, act_order=act_order, static_groups=static, overwrite=True)
    assert loss2 == loss
    for a, b in ((ref.q, got.q), (ref.scales, got.scales), (ref.zeros, got.zeros), (ref.g_idx, got.g_idx)):
        assert torch.equal(a, b)
    assert not torch.equal(H2, H)  # the caller's H was used as scratch (that is the point)
