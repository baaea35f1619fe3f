"""`CriticTrainer`: one critic's value model, optimizer and update count, usable without Ray; what a host
serves as `agent_trainer.critic.Critic` (the kind's worked example, described there).

Choices (PPO's value function, Schulman et al., 2017, unless said):

- The value model. An own LM (`critic.model`, e.g. `builtin:tiny`): its decoder's last hidden state at the
  input's last token, through a scalar head; decoder and head train (float32 throughout: a critic is small).
  `model: agent`: the same head on the hosting agent's own model, read with the agent's adapter and precision
  in place (`selected`), without gradient: only the head trains. PPO's shared actor-critic trains the trunk
  on the value loss too; here the agent's update alone moves it, so the critic never changes the policy.
- The head starts at zero (every first value is 0: the first advantages are the plain discounted returns)
  and the critic's construction runs in a forked RNG, so a critic never moves its process's random streams:
  the agents' sampling is the same with or without it. Updates draw no random numbers.
- Forwards are shared: a state whose tokens begin another state's is read inside that one's forward (`_batches`),
  so an episode's turns cost about one forward of its longest state.
- The update: `critic.num_iterations` passes over the step's targets in micro-batches, each pass one AdamW
  step on the mean of `losses.value_loss` (clipped by `critic.value_clip` around the rollout's values), the
  gradient norm clipped to `critic.optimizer.max_grad_norm`; a pass whose loss or gradient is not finite does
  not step.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from agent_trainer import losses
from agent_trainer.models import load_model
from agent_trainer.precision import Precision
from agent_trainer.guarded_step import GuardedSteps
from agent_trainer.trainer import AgentTrainer, lr_factor, refuse_nonfinite, weights_digest
from protocols.config import CriticConfig
from protocols.messages import CriticUpdateResult, ValueTarget

HEAD_FILE = "value_head.pt"
STATE_FILE = "critic_state.pt"
MODEL_DIR = "model"


def shared_rows(rows: list[list[int]]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """The rows to forward (carriers, longest first) and, per carrier, the rows read inside it: (row index, position
    of its last token). A row is read inside the first carrier it begins (carriers are made longest first, ties in
    row order); a row that begins none is a carrier of its own.

    In lexicographic order the rows that begin with a row r follow r as one block, and r's carrier is the longest
    row of its block (ties: the first in row order): a walk over the sorted rows with a stack of the rows that begin
    the current one finds every block's best in one pass, so the cost is the sort's, O(N log N) comparisons of rows,
    not a comparison of every row with every carrier."""
    n = len(rows)
    order = sorted(range(n), key=lambda i: rows[i])  # stable: equal rows stay in row order
    rank = lambda i: (len(rows[i]), -i)  # noqa: E731  the carrier of a block: the longest, then the first
    best = list(range(n))  # per row: the best row of the rows that begin with it (its block)
    same = list(range(n))  # per row: the first row equal to it, whose block it shares
    stack: list[int] = []
    for i in order:
        if stack and rows[i] == rows[stack[-1]]:
            same[i] = stack[-1]
            continue
        while stack and rows[i][:len(rows[stack[-1]])] != rows[stack[-1]]:
            _close(stack, best, rank)
        stack.append(i)
    while stack:
        _close(stack, best, rank)
    carriers: list[list[int]] = []
    reads: list[list[tuple[int, int]]] = []
    carrier_of: dict[int, int] = {}  # row -> its carrier's index in `carriers`
    for i in sorted(range(n), key=lambda i: -len(rows[i])):
        home = best[same[i]]
        if home == i:
            carrier_of[i] = len(carriers)
            carriers.append(rows[i])
            reads.append([])
        reads[carrier_of[home]].append((i, len(rows[i]) - 1))
    return carriers, reads


def _close(stack: list[int], best: list[int], rank) -> None:
    """Pop the top row's block: its best is final and competes for the block that holds it."""
    done = stack.pop()
    if stack and rank(best[done]) > rank(best[stack[-1]]):
        best[stack[-1]] = best[done]


class CriticTrainer:
    """One critic's value model, optimizer and update count. `agent`: the trainer of the hosting agent whose
    model carries the head (`critic.model: agent`); None for a critic with an LM of its own."""

    def __init__(self, name: str, critic: CriticConfig, *, seed: int, total_updates: int,
                 agent: AgentTrainer | None = None):
        loading = time.perf_counter()
        self.name, self.config, self.agent = name, critic, agent
        self.total_updates, self.policy_version = max(1, total_updates), 0
        with torch.random.fork_rng(devices=[]):  # a critic never moves its process's random streams
            torch.manual_seed(seed)
            if agent is None:
                self.device = torch.device("cpu")
                lm, self.tokenizer = load_model(critic.model, dtype="float32", device=self.device)
                self.decoder = lm.get_decoder()  # the LM without its output head: what the values read
                self.decoder.eval()  # dropout off, as an agent's update
                self.lm = lm
                hidden = lm.config.hidden_size
            else:
                self.device, self.tokenizer, self.lm, self.decoder = agent.device, agent.tokenizer, None, None
                hidden = agent.model.config.hidden_size
            self.head = torch.nn.Linear(hidden, 1).to(self.device)
            torch.nn.init.zeros_(self.head.weight)
            torch.nn.init.zeros_(self.head.bias)
        self.optimizer = torch.optim.AdamW(self._trainable_parameters(), lr=critic.optimizer.lr,
                                           betas=critic.optimizer.betas, weight_decay=critic.optimizer.weight_decay)
        self.precision = Precision("float32", "a critic computes in float32" if agent is None else
                                   f"a head on agent {agent.name}'s model, in its precision", str(self.device))
        self.engine = None  # a critic samples nothing
        self.load_seconds = time.perf_counter() - loading

    # ---------------------------------------------------------------------------------- values
    def values(self, states: list[str]) -> list[float]:
        """The value of each state, in order (no gradient)."""
        out = [0.0] * len(states)
        with torch.no_grad():
            for indices, values in self._batches(states):
                for i, v in zip(indices, values.tolist()):
                    out[i] = v
        return out

    def _batches(self, states: list[str]):
        """(indices of states, their (B,) values) per micro-batch of `micro_batch_size` forwards.

        One forward serves every state whose tokens begin another's: a causal LM's hidden state at a position
        sees nothing after it, so a state's value read inside a longer row equals its own forward's. An
        episode's states are such prefixes of each other (`orchestrator.credit.critic_state`), so its turns
        cost about one forward of the longest instead of one per turn."""
        rows = [self.tokenizer(s).input_ids[-self.config.max_length:] or [self.tokenizer.pad_token_id] for s in states]
        carriers, reads = shared_rows(rows)
        for start in range(0, len(carriers), self.config.micro_batch_size):
            batch = range(start, min(start + self.config.micro_batch_size, len(carriers)))
            width = max(len(carriers[c]) for c in batch)
            ids = torch.full((len(batch), width), self.tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for b, c in enumerate(batch):  # right-padded: each row keeps its own positions
                ids[b, :len(carriers[c])], mask[b, :len(carriers[c])] = torch.tensor(carriers[c]), 1
            hidden = self._hidden(ids.to(self.device), mask.to(self.device))  # (B, T, H)
            picks = [(b, i, pos) for b, c in enumerate(batch) for i, pos in reads[c]]
            rows_at = torch.tensor([b for b, _, _ in picks], device=self.device)
            cols_at = torch.tensor([pos for _, _, pos in picks], device=self.device)
            chosen = hidden[rows_at, cols_at].float()  # (S, H): each state's last token
            yield [i for _, i, _ in picks], self.head(chosen).squeeze(-1)  # (S,)

    def _hidden(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.agent is None:
            return self.decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        with self.agent.selected(), self.agent._autocast(), torch.no_grad():  # the agent's model: never trained here
            return self.agent.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]

    # ---------------------------------------------------------------------------------- update
    def update(self, targets: list[ValueTarget]) -> CriticUpdateResult:
        """`num_iterations` passes of PPO's value loss over `targets`."""
        start = time.perf_counter()
        if not targets:
            raise ValueError(f"critic {self.name!r}: an update needs at least one value target")
        cfg, opt = self.config, self.config.optimizer
        lr = opt.lr * lr_factor(opt, self.policy_version, self.total_updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        returns = torch.tensor([t.target for t in targets], dtype=torch.float32)  # (N,)
        old = torch.tensor([t.old_value for t in targets], dtype=torch.float32)  # (N,)
        variance = float(returns.var(unbiased=False))
        explained = 1.0 - float((returns - old).var(unbiased=False)) / variance if variance > 0 else 0.0
        total_loss = total_clipped = 0.0
        steps = GuardedSteps()
        parameters = self._trainable_parameters()
        for _ in range(cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            finite = True
            for indices, values in self._batches([t.state for t in targets]):  # (S,) values per micro-batch
                batch = torch.tensor(indices)
                per_state, clipped = losses.value_loss(values, old[batch].to(self.device),
                                                       returns[batch].to(self.device), cfg.value_clip)  # (S,), (S,)
                loss = per_state.sum() / len(targets)  # the whole batch's mean, accumulated over micro-batches
                if not torch.isfinite(loss):
                    finite = False
                    break
                loss.backward()
                total_loss += float(loss.detach())
                total_clipped += float(clipped.float().sum()) / len(targets)
            steps.step(self.optimizer, parameters, max_grad_norm=opt.max_grad_norm, finite=finite)
        self.optimizer.zero_grad(set_to_none=True)
        self.policy_version += 1
        n = cfg.num_iterations
        return CriticUpdateResult(critic=self.name, version=self.policy_version, value_loss=total_loss / n,
                                  value_clip_fraction=total_clipped / n, explained_variance=explained,
                                  grad_norm=steps.mean_grad_norm, lr=lr, num_states=len(targets), skipped_steps=steps.skipped,
                                  seconds=time.perf_counter() - start)

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        own = list(self.decoder.parameters()) if self.decoder is not None else []
        return own + list(self.head.parameters())

    # ------------------------------------------------------------------------------- save/load
    def save(self, path: str | Path) -> None:
        """The head (`value_head.pt`), an own LM's weights (HF format under `model/`, once trained) and the
        optimizer and update count (`critic_state.pt`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        named = {f"head.{n}": p for n, p in self.head.named_parameters()}
        if self.lm is not None:
            named.update(dict(self.lm.named_parameters()))
        refuse_nonfinite(self.name, "critic", named)
        torch.save(self.head.state_dict(), path / HEAD_FILE)
        if self.lm is not None and self.policy_version > 0:  # before its first update the LM is still config.model's
            self.lm.save_pretrained(path / MODEL_DIR)
        torch.save({"optimizer": self.optimizer.state_dict(), "version": self.policy_version}, path / STATE_FILE)
        (path / "critic.json").write_text(json.dumps({"model": self.config.model, "kind": self.config.kind}))

    def load(self, path: str | Path, *, checkpoint: str | None = None) -> None:
        """What `save` wrote, in place; an own LM saved before its first update comes from `critic.model`.
        `checkpoint` (how an agent's load names the checkpoint in its messages) is taken for the same call."""
        path = Path(path)
        if self.lm is not None:
            with torch.random.fork_rng(devices=[]):
                if (path / MODEL_DIR).is_dir():
                    lm = AutoModelForCausalLM.from_pretrained(path / MODEL_DIR, dtype=torch.float32)
                else:
                    lm, _ = load_model(self.config.model, dtype="float32")
            self.lm.load_state_dict(lm.state_dict())
        self.head.load_state_dict(torch.load(path / HEAD_FILE, weights_only=True))
        state = torch.load(path / STATE_FILE, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.policy_version = state["version"]

    def parameters_digest(self) -> str:
        named = {f"head.{n}": p for n, p in self.head.named_parameters()}
        if self.lm is not None:
            named.update(dict(self.lm.named_parameters()))
        return weights_digest(named)

    def selected(self, *, updating: bool = False):
        """Nothing to switch: a head on an agent's model selects that agent's adapter itself (`_hidden`)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        pass
