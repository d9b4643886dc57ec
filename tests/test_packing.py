"""Packing parameters into a flat buffer (``dml_optim.core.flat.pack_values``): values, rebinding, and a
failure part-way leaving every parameter with its values in a storage of its own."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dml_optim.core.flat import pack_values

SHAPES = [(3, 4), (5,), (2, 2, 2), (7,)]


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


@pytest.mark.parametrize("via_host", [False, True], ids=["direct", "via-host"])
def test_values_are_packed_back_to_back_and_parameters_become_views(via_host):
    params = _params()
    expected = torch.cat([p.detach().reshape(-1) for p in params])
    flat = pack_values(params, expected.numel(), torch.float32, torch.device("cpu"), via_host, rebind=params)
    assert torch.equal(flat, expected)
    offset = 0
    for p, shape in zip(params, SHAPES):
        assert p.shape == shape and p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert p.data_ptr() == flat[offset:].data_ptr()
        offset += p.numel()


def test_an_old_storage_is_released_as_soon_as_its_parameter_is_packed():
    """No list of the originals is kept: the peak is about one copy of the parameters, not two."""
    params = _params()
    old = [weakref.ref(p.untyped_storage()) for p in params]
    released_while_packing = []

    # the last source is read after the first three were packed: by then their storages are gone
    real_reshape = torch.Tensor.reshape

    def reshape(self, *shape):
        if self.shape == SHAPES[-1]:
            gc.collect()
            released_while_packing.extend(r() is None for r in old[:-1])
        return real_reshape(self, *shape)

    torch.Tensor.reshape = reshape
    try:
        pack_values(params, sum(p.numel() for p in params), torch.float32, torch.device("cpu"), False, rebind=params)
    finally:
        torch.Tensor.reshape = real_reshape
    assert released_while_packing == [True, True, True]


@pytest.mark.parametrize("via_host", [False, True], ids=["direct", "via-host"])
def test_a_failure_part_way_gives_every_parameter_its_values_back(via_host):
    params = _params()
    before = [p.detach().clone() for p in params]
    short = sum(p.numel() for p in params) - 1  # the last copy does not fit: fails after three were packed
    with pytest.raises(RuntimeError):
        pack_values(params, short, torch.float32, torch.device("cpu"), via_host, rebind=params)
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == len(params)  # each in a storage of its own, none a view of the failed flat tensor
    for p, b, shape in zip(params, before, SHAPES):
        assert p.shape == shape and p.device.type == "cpu" and torch.equal(p.detach(), b)


def test_constructing_over_a_sparse_grad_names_the_parameter_and_changes_nothing():
    """The constructor refuses an existing sparse ``.grad`` as clearly as ``step()`` does (not reshape's error)."""
    import dml_optim

    dense = torch.nn.Parameter(torch.ones(3))
    p = torch.nn.Parameter(torch.arange(4.0))
    p.grad = torch.ones(4).to_sparse()
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\] has a sparse \.grad.*dense gradients"):
        dml_optim.Adam([dense, p])
    assert torch.equal(p.detach(), torch.arange(4.0)) and p.grad.is_sparse
    assert torch.equal(dense.detach(), torch.ones(3))
