"""Weights from an agent's learner to its rollout engine of its own (`rollout.placement: separate`) through a
torch.distributed group of the two processes: gloo on CPU, NCCL on GPU.

The learner (rank 0) broadcasts its live tensors; the engine (rank 1) receives them into its own, in place. A
tensor of at least `_BUCKET_BYTES` travels alone, straight into the engine's tensor where its dtype matches; smaller
ones travel together in flat buffers of one dtype and at most `_BUCKET_BYTES`, so the extra memory on either side is
one bucket (or one large tensor whose dtype differs between the two sides). Tensors that share storage (a tied
embedding and output layer) travel once.

Every transfer opens with a header that both sides check before any weight moves: the policy version the learner
holds against the one asked for, and the tensors' names and shapes against the engine's. Either side's refusal is
seen by both (an all-reduce of the verdicts), so neither waits for a transfer that will not come.

On one node, with a CPU engine, the bytes do not go over the group's socket: the engine's weights become shared
memory at the first transfer and the learner writes each version there (`agent_trainer.shared_weights`), the group
carrying the header and the word that the learner is done. Over gloo's TCP transport a SmolLM2 version took 18x
the time of one in-memory copy of its weights; written into shared memory, 0.9-1.4x (benchmarks/RESULTS.md).

The group is private to the two processes (its own store, not the default group a data-parallel learner is in);
`agent_trainer.actor` forms it at start, or falls back to Ray's object store (`weight_wire`) where it cannot."""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import warnings
from typing import TYPE_CHECKING

from agent_trainer.shared_weights import EngineSegment, LearnerViews, NoRoom

if TYPE_CHECKING:  # torch loads in the trainers only
    import torch
    import torch.distributed as dist

_BUCKET_BYTES = 16 << 20
LEARNER = 0  # the rank that sends; the engine is rank 1
_BROADCAST, _SHARED = 1, 2  # how the bytes go: broadcast over the group, or written into the engine's shared memory


@functools.cache
def _dtypes() -> list:
    """The dtypes the channel carries, by their code in a transfer's header."""
    import torch

    return [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
            torch.bool]


def unique(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """`tensors` in order, without those whose storage, offset and shape an earlier one has (tied weights)."""
    seen, out = set(), []
    for name, tensor in tensors.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if key not in seen:
            seen.add(key)
            out.append((name, tensor))
    return out


def layout_digest(entries: list[tuple[str, torch.Tensor]]) -> int:
    """A 63-bit digest of the entries' names and shapes, in order: equal on both sides when they hold the same
    tensors."""
    text = "\n".join(f"{name}:{tuple(t.shape)}" for name, t in entries)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def buckets(sizes: list[tuple[int, object]], bucket_bytes: int = _BUCKET_BYTES) -> list[list[int]]:
    """Indices of the entries sent together, in order, from each entry's (bytes, dtype): an entry of at least
    `bucket_bytes` alone; smaller consecutive ones of one dtype together up to `bucket_bytes`."""
    out: list[list[int]] = []
    total, joinable = 0, None  # the dtype the last bucket still takes more of, if any
    for i, (nbytes, dtype) in enumerate(sizes):
        if nbytes < bucket_bytes and dtype == joinable and total + nbytes <= bucket_bytes:
            out[-1].append(i)
            total += nbytes
        else:
            out.append([i])
            total = nbytes
        joinable = dtype if nbytes < bucket_bytes else None
    return out


class ChannelRefused(RuntimeError):
    """A transfer that one side refused at its header; nothing was sent, the engine's weights are unchanged."""

    def __init__(self, agent: str, reason: str, by_peer: bool = False):
        """`by_peer`: this side accepted; the other refused (its own error says why)."""
        super().__init__(f"agent {agent!r}: {reason}")
        self.agent, self.reason, self.by_peer = agent, reason, by_peer

    def __reduce__(self):  # raised in a trainer process, read in the coordinator's
        return type(self), (self.agent, self.reason, self.by_peer)


class WeightChannel:
    """One side of the two-process group between an agent's learner and its engine."""

    def __init__(self, store: dist.Store, rank: int, *, device: torch.device, timeout_s: float, agent: str,
                 local: bool = False):
        """`local`: the two processes are on one node, where a CPU engine's weights can be shared memory."""
        import torch.distributed as dist

        self.rank, self.device, self.agent = rank, device, agent
        self.local = local and device.type == "cpu"
        self.segment: EngineSegment | None = None  # the engine's, once its weights are shared memory
        self.views: LearnerViews | None = None  # the learner's map of that segment
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = self.store = dist.PrefixStore(f"marsi-weights/{agent}", store)
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
            self.backend = "nccl"
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
            self.backend = "gloo"

    # ------------------------------------------------------------------------------------------- the two sides
    def send(self, tensors: dict[str, torch.Tensor], version: int, holds: int) -> int:
        """The learner: broadcast `tensors` (its weights at policy `holds`) as policy `version`; the bytes sent.
        Refused, on both sides, unless `holds == version` and the engine holds tensors of the same names and
        shapes."""
        import torch

        entries = unique(tensors)
        carried = _dtypes()
        codes = [carried.index(t.dtype) if t.dtype in carried else -1 for _, t in entries]
        header = torch.tensor([version, len(entries), layout_digest(entries)], dtype=torch.int64, device=self.device)
        self._broadcast(header)
        mine = "" if holds == version else (f"its learner holds policy version {holds}, not the {version} asked "
                                            "for")
        if -1 in codes and not mine:
            name, tensor = entries[codes.index(-1)]
            mine = f"its learner's tensor {name} is {tensor.dtype}, which the weight channel does not carry"
        if self._agree(mine, _SHARED if self.local else _BROADCAST) == _SHARED:
            written = None
            try:
                if self.views is None:  # the engine laid its weights out in shared memory at the first transfer
                    self.views = LearnerViews(json.loads(self.store.get("segment")))
                written = self.views.write(entries)
            except Exception as exc:  # noqa: BLE001 - said, and the broadcast takes over
                warnings.warn(f"agent {self.agent!r}: its learner sends its weights by broadcast: it cannot write "
                              f"into its engine's shared memory ({type(exc).__name__}: {exc})", stacklevel=2)
                self.local, self.views = False, None
            done = torch.tensor([written is not None], dtype=torch.int64, device=self.device)
            self._broadcast(done)  # 1: the engine may sample again; 0: the broadcast follows
            if written is not None:
                return written
        self._broadcast(torch.tensor(codes, dtype=torch.int8, device=self.device))
        sent = 0
        for group in buckets([(t.numel() * t.element_size(), t.dtype) for _, t in entries]):
            parts = [entries[i][1] for i in group]
            flat = parts[0].contiguous() if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self, tensors: dict[str, torch.Tensor], version: int, owner: torch.nn.Module | None = None) -> None:
        """The engine: receive policy `version` into `tensors` (its own live weights, named as in `owner`), in place.
        On the learner's node, with `owner` given, the first transfer moves them into shared memory, where the
        learner writes every version (`agent_trainer.shared_weights`)."""
        import torch

        entries = self.segment.entries if self.segment is not None else unique(tensors)  # what it computes with
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._broadcast(header)
        got_version, count, digest = (int(x) for x in header.tolist())
        mine = ""
        if got_version != version:
            mine = f"the learner sent policy version {got_version}, the engine asked for {version}"
        elif count != len(entries) or digest != layout_digest(entries):
            mine = (f"the learner sends {count} tensors, the engine holds {len(entries)} (or their names or shapes "
                    "differ); learner and engine must load the same model (and attach the same adapter)")
        shared = self.local and owner is not None
        if shared and not mine and self.segment is None:
            segment = None
            try:
                segment = EngineSegment(entries, owner)
                self.store.set("segment", json.dumps(segment.layout))
            except Exception as exc:  # noqa: BLE001 - nothing of the engine's moved: broadcast, now and from now on
                if segment is not None:
                    segment.discard()
                reason = f"no room for {exc}" if isinstance(exc, NoRoom) else f"{type(exc).__name__}: {exc}"
                warnings.warn(f"agent {self.agent!r}: its rollout engine takes its weights by broadcast, not in "
                              f"shared memory ({reason})", stacklevel=2)
                shared = self.local = False
            else:
                segment.adopt()
                self.segment, entries = segment, segment.entries
        if self._agree(mine, _SHARED if shared else _BROADCAST) == _SHARED:
            done = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._broadcast(done)  # the learner has written every tensor, or could not
            self.segment.forget_name()  # both processes map it now, or the learner never will
            if int(done.item()) == 1:
                return
            self.local = False  # the broadcast, into the segment, now and from now on
        codes = torch.zeros(count, dtype=torch.int8, device=self.device)
        self._broadcast(codes)
        dtypes = [_dtypes()[c] for c in codes.tolist()]
        sizes = [(t.numel() * dtypes[i].itemsize, dtypes[i]) for i, (_, t) in enumerate(entries)]
        with torch.no_grad():
            for group in buckets(sizes):
                targets = [entries[i][1] for i in group]
                dtype = dtypes[group[0]]
                if len(group) == 1 and targets[0].dtype == dtype and targets[0].is_contiguous() \
                        and targets[0].device == self.device:
                    self._broadcast(targets[0])  # straight into the engine's tensor
                    continue
                flat = torch.empty(sum(t.numel() for t in targets), dtype=dtype, device=self.device)
                self._broadcast(flat)
                offset = 0
                for target in targets:
                    target.copy_(flat[offset:offset + target.numel()].view(target.shape))
                    offset += target.numel()

    # ---------------------------------------------------------------------------------------------- plumbing
    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, LEARNER).wait()

    def _agree(self, mine: str, way: int) -> int:
        """Both sides' verdicts on the header: raise ChannelRefused on both unless both accept; the way the bytes
        go, the one both sides can take (`_SHARED` only where both can)."""
        import torch
        import torch.distributed as dist

        verdict = torch.tensor([0 if mine else way], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([verdict], options).wait()
        if mine:
            raise ChannelRefused(self.agent, f"weights not sent to its rollout engine: {mine}")
        if int(verdict.item()) == 0:
            side = "engine" if self.rank == LEARNER else "learner"
            raise ChannelRefused(self.agent, f"weights not sent to its rollout engine: its {side} refused the "
                                 "transfer (its error says why)", by_peer=True)
        return int(verdict.item())
