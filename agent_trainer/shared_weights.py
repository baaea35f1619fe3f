"""An engine's weights in shared memory, which its learner on the same node writes into: one copy per version.

Over a socket (gloo's TCP transport) a policy version costs the bytes' trip through the kernel on both sides; on
one node the engine instead moves its own weights into a shared-memory segment once (`EngineSegment`: each
tensor becomes a view of the segment, so the engine computes with them there, and holds no second copy), and its
learner maps that segment and copies its tensors into it at each version (`LearnerViews`), casting where the two
hold different dtypes. The weight channel (`agent_trainer.weight_channel`) orders the two: the engine is waiting
in the channel while the learner writes, and samples again only once the learner says it is done.

Where the node's shared memory (/dev/shm) cannot hold the weights, the engine says so (`NoRoom`) and the
channel broadcasts instead. The segment's name exists only until the first version has arrived, when both processes map it: a process
killed after that leaves nothing behind, and one killed before it is cleaned up by Python's resource tracker."""

from __future__ import annotations

import itertools
import math
import os
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_ALIGN = 64
_names = itertools.count()


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _tensor_of(owner: torch.nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer `name` of `owner` (the object the module holds, not a copy)."""
    try:
        return owner.get_parameter(name)
    except AttributeError:
        return owner.get_buffer(name)


class NoRoom(OSError):
    """The node's shared memory cannot hold the engine's weights."""


class EngineSegment:
    """The engine's side: a new segment laid out for its tensors `entries` (named as in `owner`), which `adopt` then
    moves there. Made in two steps so that anything that can fail (a name `owner` does not hold, no room) fails
    before a single tensor of the engine's has moved."""

    def __init__(self, entries: list[tuple[str, torch.Tensor]], owner: torch.nn.Module):
        import torch

        self.targets = [_tensor_of(owner, name) for name, _ in entries]  # the module's own tensors
        offsets, total = [], 0
        for _, tensor in entries:
            offsets.append(total)
            total += _aligned(tensor.numel() * tensor.element_size())
        self.memory = shared_memory.SharedMemory(name=f"marsi-weights-{os.getpid()}-{next(_names)}", create=True,
                                                 size=max(total, _ALIGN))
        self.named = True
        try:  # every page now: a full /dev/shm (a container's is often 64 MB) refuses here, not with a SIGBUS later
            os.posix_fallocate(self.memory._fd, 0, self.memory.size)  # noqa: SLF001 - the segment's own descriptor
        except OSError as exc:
            self.discard()
            raise NoRoom(f"{self.memory.size} bytes of shared memory: {exc}") from None
        base = torch.frombuffer(self.memory.buf, dtype=torch.uint8)
        self.entries = [(name, base[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
                        for (name, t), offset in zip(entries, offsets)]  # the engine's tensors, once adopted
        self.layout: dict[str, Any] = {"name": self.memory.name, "tensors": [
            [name, str(t.dtype).removeprefix("torch."), list(t.shape), offset]
            for (name, t), offset in zip(entries, offsets)]}

    def adopt(self) -> None:
        """Copy the engine's tensors into the segment and make the module compute with them there."""
        import torch

        with torch.no_grad():
            for target, (_, view) in zip(self.targets, self.entries):
                view.copy_(target)
                target.data = view
        self.targets = []

    def discard(self) -> None:
        """A segment not adopted: gone."""
        self.entries = []
        self.memory.close()
        self.forget_name()

    def forget_name(self) -> None:
        """Once the learner maps the segment: remove its name (the memory lives while either process maps it)."""
        if self.named:
            self.memory.unlink()
            self.named = False


class LearnerViews:
    """The learner's side: the engine's segment (`EngineSegment.layout`), mapped, as one view per tensor."""

    def __init__(self, layout: dict[str, Any]):
        import torch

        try:
            self.memory = shared_memory.SharedMemory(name=layout["name"], track=False)
        except TypeError:  # Python < 3.13 tracks every segment it opens, and would unlink this one at exit
            from multiprocessing import resource_tracker

            self.memory = shared_memory.SharedMemory(name=layout["name"])
            resource_tracker.unregister(self.memory._name, "shared_memory")  # noqa: SLF001 - as 3.13's track=False
        base = torch.frombuffer(self.memory.buf, dtype=torch.uint8)
        self.views = []
        for name, dtype, shape, offset in layout["tensors"]:
            dtype = getattr(torch, dtype)
            nbytes = math.prod(shape) * dtype.itemsize
            self.views.append((name, base[offset:offset + nbytes].view(dtype).view(shape)))

    def write(self, entries: list[tuple[str, torch.Tensor]]) -> int:
        """Copy `entries` (the learner's tensors, in the engine's order) into the segment; the bytes written."""
        import torch

        if [n for n, _ in entries] != [n for n, _ in self.views]:
            raise ValueError("the engine's shared weights are laid out for other tensors than the learner's")
        written = 0
        with torch.no_grad():
            for (_, tensor), (_, view) in zip(entries, self.views):
                view.copy_(tensor)
                written += view.numel() * view.element_size()
        return written
