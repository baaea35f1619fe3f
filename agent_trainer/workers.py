"""Data parallelism: one agent on several workers, each a process holding a full copy of the agent.

An agent with `resources.num_workers: K` is K worker processes (Ray actors, `agent_trainer.actor`) joined
into one torch.distributed process group: gloo on CPU, NCCL on GPU. Worker 0 opens the group's store on a
free port of its node (`open_store`); the driver passes that address to every worker (`join`). Nothing is
configured by hand. To everything above `agent_trainer/` the K workers are one agent; how each call fans out
over them is declared on its method (`agent_trainer.dispatch`, `agent_trainer.agent.Agent`):

- **Generate.** Every worker gets the whole request and decodes its share of the rows (`rows`: contiguous,
  in order, the first `n % K` workers one row more); the pool concatenates the shares in worker order
  (`Dispatch.ROWS`). A row's sample depends on the request's seed and the row's index only
  (`agent_trainer.sampling`), so K does not change what is sampled.
- **Update.** Every worker gets the whole batch, counts its tokens and sequences (the loss's normalisers:
  the whole batch's, as one worker would use), and trains on its share. After each pass over its
  micro-batches it all-reduces (SUM) the gradients (`reduce_gradients`), so every worker holds the whole
  batch's gradient and clips it by its global norm, then steps the same optimizer state to the same
  weights. The update's statistics are summed (largest values: maxed) across workers (`reduce_stats`), so
  the UpdateResult is the whole batch's (`Dispatch.ALL_EQUAL` checks that the workers' results agree). Gradients are summed rather than averaged because each
  worker's loss is already divided by the whole batch's count.
- **Checkpoints.** The workers hold the same weights and optimizer state, so worker 0 alone saves (one
  copy, the single-worker layout: `Dispatch.RANK_ZERO`) and every worker loads the same files: a checkpoint
  loads on any K.
- **Failures.** A worker that dies or hangs is a failure of its agent (`agent_trainer.actor`): the whole
  group is restarted and restored, like a single trainer.

`SingleWorker` is the one-worker case: its share is everything and there is nothing to reduce, so the
learner's loop is the same for both.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:  # torch loads in the workers
    import torch
    import torch.distributed as dist

_BUCKET = 1 << 24  # gradient elements all-reduced at once: bounds the flat buffer to 64 MiB of float32


def share(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [first, last) of `n` that worker `rank` of `world_size` takes: contiguous, in worker order,
    the first `n % world_size` workers one row more."""
    base, extra = divmod(n, world_size)
    first = rank * base + min(rank, extra)
    return first, first + base + (rank < extra)


class SingleWorker:
    """An agent on one worker: it takes every row, and its gradients and statistics are the whole batch's."""

    rank, world_size = 0, 1

    def rows(self, n: int) -> tuple[int, int]:
        return 0, n

    def reduce_gradients(self, parameters: Iterable[torch.nn.Parameter], finite: bool) -> bool:
        return finite

    def reduce_stats(self, stats: dict[str, float], maxima: Sequence[str]) -> None:
        pass


class DataParallel:
    """Worker `rank` of an agent's `world_size` workers, in the default torch.distributed process group."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device

    def rows(self, n: int) -> tuple[int, int]:
        return share(n, self.rank, self.world_size)

    def reduce_gradients(self, parameters: Iterable[torch.nn.Parameter], finite: bool) -> bool:
        """Sum every trainable parameter's gradient over the workers, in place; whether every worker's loss
        was finite. A parameter no worker gave a gradient keeps none (the optimizer skips it, as on one worker)."""
        import torch

        with torch.no_grad():
            return self._reduce_gradients(parameters, finite)

    def _reduce_gradients(self, parameters: Iterable[torch.nn.Parameter], finite: bool) -> bool:
        import torch
        import torch.distributed as dist

        params = [p for p in parameters if p.requires_grad]
        flags = torch.tensor([p.grad is not None for p in params] + [not finite], dtype=torch.float32,
                             device=self.device)  # (P + 1,) who has a gradient; who saw a non-finite loss
        dist.all_reduce(flags)
        start = 0
        while start < len(params):  # buckets of about _BUCKET elements, one all-reduce each
            end, size = start, 0
            while end < len(params) and (end == start or size + params[end].numel() <= _BUCKET):
                size += params[end].numel()
                end += 1
            bucket = params[start:end]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in bucket])  # (size,)
            dist.all_reduce(flat)
            offset = 0
            for i, p in enumerate(bucket, start):
                if flags[i] > 0:
                    p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            start = end
        return bool(flags[-1] == 0)

    def reduce_stats(self, stats: dict[str, float], maxima: Sequence[str]) -> None:
        """Sum `stats` over the workers in place; the keys in `maxima` take the largest value instead."""
        import torch
        import torch.distributed as dist

        keys = [k for k in stats if k not in maxima]
        sums = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        largest = torch.tensor([stats[k] for k in maxima], dtype=torch.float64, device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        stats.update(zip(keys, sums.tolist()))
        stats.update(zip(maxima, largest.tolist()))


# ------------------------------------------------------------------ joining a group (run in each worker)
def open_store(*, address: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Worker 0: open the group's store on a free port of `address` (this node's); its caller keeps it (its
    `port` is where the other workers join) and hands it to `join`."""
    import torch.distributed as dist

    return dist.TCPStore(address, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def join(trainer: Any, *, address: str, port: int, rank: int, world_size: int, timeout_s: float,
         store: dist.TCPStore | None = None) -> None:
    """Join the agent's process group as worker `rank` (worker 0 with `store`, the one it opened), start from
    worker 0's weights, and make the trainer's learner data-parallel. `timeout_s` bounds the rendezvous and
    every collective (a dead peer fails a collective at once; a hung one after this)."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0 and store is None:
        raise ValueError("workers.join: worker 0 joins with the store it opened (open_store)")
    if rank != 0:
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    backend = "nccl" if trainer.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            **({"device_id": trainer.device} if backend == "nccl" else {}))
    with torch.no_grad():
        for model in (trainer.model, trainer.ref_model):
            for tensor in ([] if model is None else [*model.parameters(), *model.buffers()]):
                dist.broadcast(tensor, src=0)
    trainer.parallel = DataParallel(rank, world_size, trainer.device)
