"""Two data-parallel workers in processes of their own (torch.multiprocessing + gloo), for tests/test_workers.py.
Kept apart from the tests so that a spawned worker imports only what a trainer needs."""

from __future__ import annotations

import torch

from agent_trainer import workers
from agent_trainer.trainer import AgentTrainer
from protocols.config import AgentConfig, AlgorithmConfig
from protocols.messages import Experience, GenerateRequest, UpdateRequest

# (loss_aggregation, micro_batch_size, num_iterations): token and sequence normalisation, and micro-batches
# smaller than a worker's share (7 rows: shares of 4 and 3, micro-batches of 2)
VARIANTS = [("token", 16, 1), ("sequence", 16, 2), ("token", 2, 1)]
REQUEST = GenerateRequest(prompts=["Say a", "Say bb", "Say c", "Say dddd", "Say e", "Say ff", "Say g"], seed=3)
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 0.3, 0.2, -0.1]


def make_trainer(loss_aggregation="token", micro_batch_size=16, num_iterations=1):
    """The tiny model with a KL term and a clipping threshold the gradient exceeds (clipping by the global norm)."""
    agent = AgentConfig(model="builtin:tiny", micro_batch_size=micro_batch_size,
                        generation={"max_completion_length": 4}, optimizer={"lr": 1e-3, "max_grad_norm": 0.05})
    algorithm = AlgorithmConfig(loss_aggregation=loss_aggregation, num_iterations=num_iterations, beta=0.1)
    return AgentTrainer("a", agent, algorithm, seed=0)


def experiences(completions):
    return [Experience(prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, advantage=a,
                       old_per_token_logps=c.per_token_logps) for c, a in zip(completions, ADVANTAGES)]


def worker(rank, ports, batch, results):
    """Worker `rank` of 2, in its own process: join the group as a Ray worker does, generate its share of
    REQUEST, then one update per variant on its share of `batch`."""
    torch.set_num_threads(1)
    trainer = make_trainer()
    store = workers.open_store(address="127.0.0.1", world_size=2, timeout_s=120) if rank == 0 else None
    if rank == 0:
        port = store.port
        ports.put(port)
    else:
        port = ports.get(timeout=120)
    workers.join(trainer, address="127.0.0.1", port=port, rank=rank, world_size=2, timeout_s=120, store=store)
    completions = trainer.generate(REQUEST).completions
    updates = []
    for variant in VARIANTS:
        learner = make_trainer(*variant)
        learner.parallel = workers.DataParallel(rank, 2, learner.device)
        result = learner.update(UpdateRequest(experiences=batch))
        updates.append(({n: p.detach().numpy().copy() for n, p in learner.model.named_parameters()}, result))
    learner = make_trainer()  # last: worker 1 alone computes a non-finite loss (its weights are NaN)
    learner.parallel = workers.DataParallel(rank, 2, learner.device)
    if rank == 1:
        with torch.no_grad():
            learner.model.get_input_embeddings().weight.fill_(float("nan"))
    result = learner.update(UpdateRequest(experiences=batch))
    updates.append(({n: p.detach().numpy().copy() for n, p in learner.model.named_parameters()}, result))
    results.put((rank, completions, updates))


def die_in_a_collective(pool) -> None:
    """Agent 'a''s worker 1 is killed, then 'a' updates: worker 0's gradient all-reduce fails on its dead peer."""
    import os
    import signal

    os.kill(pool.info()["a"]["workers"][1]["pid"], signal.SIGKILL)
    batch = [Experience(prompt_ids=[10, 20, 30], completion_ids=[40, 50], advantage=a) for a in (1.0, -1.0)]
    pool["a"].update(UpdateRequest(experiences=batch))
