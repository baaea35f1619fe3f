"""Weights packed for Ray's object store (`agent_trainer.weight_wire`) come back bit for bit, in every dtype."""

from __future__ import annotations

import pytest
import torch

from agent_trainer import weight_wire


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w32": torch.randn(4, 3), "w16": torch.randn(5).to(torch.bfloat16), "h16": torch.randn(2, 2).half(),
            "ids": torch.arange(6), "tied": torch.randn(3, 3)}


@pytest.mark.fast
def test_pack_views_the_weights_and_unpack_gives_them_back_bit_for_bit():
    tensors = weights()
    payload = weight_wire.pack(tensors)
    assert payload["arrays"]["w32"].ctypes.data == tensors["w32"].data_ptr()  # a view: the store makes the copy
    back = weight_wire.unpack(payload)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_weights_through_the_object_store_come_back_bit_for_bit(ray_cluster):
    import ray

    tensors = weights()
    back = weight_wire.unpack(ray.get(ray.put(weight_wire.pack(tensors))))
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8))
    model = torch.nn.Linear(3, 4)
    model.load_state_dict({"weight": back["w32"], "bias": torch.zeros(4)})  # read-only store arrays load as a copy
    assert torch.equal(model.weight.detach(), tensors["w32"])
