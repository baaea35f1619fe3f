"""Weights between processes through Ray's object store: NumPy arrays, which Ray writes into the store once and a
reader maps without a copy (torch tensors are pickled: copied again on each side).

`pack` views each tensor's bytes as a NumPy array (a dtype NumPy lacks, such as bfloat16, as integers of its
width), so the one copy is the store's, made as the call that returns it ends: a caller in the same process gets
views of the live weights. `unpack` gives tensors over the arrays it is handed (read-only in the store: a reader
copies them into its own parameters, as `load_state_dict` does)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

_AS_INTEGERS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def pack(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """{"arrays": name -> NumPy view of the tensor on the CPU, "dtypes": name -> torch dtype name}."""
    arrays, dtypes = {}, {}
    for name, tensor in tensors.items():
        cpu = tensor.detach().to("cpu")
        dtypes[name] = str(cpu.dtype).removeprefix("torch.")
        arrays[name] = (cpu.view(_AS_INTEGERS[cpu.dtype]) if cpu.dtype in _AS_INTEGERS else cpu).numpy()
    return {"arrays": arrays, "dtypes": dtypes}


def unpack(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors `pack` was given, over the payload's arrays (no copy)."""
    out = {}
    with warnings.catch_warnings():  # the store's arrays are read-only; the tensors are only read from
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, array in payload["arrays"].items():
            dtype = getattr(torch, payload["dtypes"][name])
            tensor = torch.from_numpy(array)
            out[name] = tensor.view(dtype) if dtype in _AS_INTEGERS else tensor
    return out
