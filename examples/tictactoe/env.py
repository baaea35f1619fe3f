"""Tic-tac-toe self-play (SPIRAL-style): one agent plays both seats of a zero-sum game.

Roles `X` and `O`; only the side to move acts each turn, so with both roles assigned to one agent its
role switches every turn. The prompt shows the board with empty cells numbered 1-9 and lists them; the
move is the first integer in the reply. At the end the rewards are per role: +1 for the winner, -1 for
the loser, 0 each for a draw. An invalid move (no integer, off the board, or an occupied cell) loses at
once: -1 for the mover, +1 for the other seat, and infos[mover] says why. Use `algorithm.baseline: ema`
(an EMA return baseline per role, SPIRAL's role-conditioned advantage estimation).

With `opponent="random"` the environment itself plays one seat, uniformly at random among the empty
cells (seeded from reset's seed), and the agent plays only the other (`agent_seat`: "X", "O", or
"random" per episode). That measures the win rate against a random player.

Samples are openings: a board with 0-2 random moves already played (see make_dataset).

episode_info: `legal_move_rate` (legal agent moves / agent moves), `moves` (agent moves), and with an
opponent `win`, `draw`, `loss` from the agent's side.
"""

from __future__ import annotations

import random
import re

import datasets

from protocols.env import Environment, StepResult
from protocols.splits import in_split

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
_INT = re.compile(r"-?[0-9]+")


def winner(board: list[str]) -> str | None:
    """'X' or 'O' when that side has three in a row, else None."""
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return None


def empty_cells(board: list[str]) -> list[int]:
    """Empty cells, numbered 1-9."""
    return [i + 1 for i, cell in enumerate(board) if cell == "."]


def render(board: list[str]) -> str:
    rows = [" " + " | ".join(board[r * 3 + c] if board[r * 3 + c] != "." else str(r * 3 + c + 1) for c in range(3))
            for r in range(3)]
    return "\n---+---+---\n".join(rows)


def other(side: str) -> str:
    return "O" if side == "X" else "X"


class TicTacToeEnv(Environment):
    possible_agents = ["X", "O"]

    def __init__(self, opponent: str | None = None, agent_seat: str = "random"):
        if opponent not in (None, "none", "random"):
            raise ValueError(f"opponent must be None or 'random', got {opponent!r}")
        if agent_seat not in ("X", "O", "random"):
            raise ValueError(f"agent_seat must be 'X', 'O' or 'random', got {agent_seat!r}")
        self.opponent = opponent if opponent != "none" else None
        self.agent_seat = agent_seat
        self.max_turns = 5 if self.opponent else 9  # agent moves per game at most

    # --------------------------------------------------------------------------------- episode
    def reset(self, sample, seed=None):
        self.board = list(sample.get("board", "........."))
        self.rng = random.Random(seed)
        self.moves = self.legal = 0
        self.result: dict[str, float] | None = None
        self.to_move = "X" if self.board.count("X") == self.board.count("O") else "O"
        self.seat = None
        if self.opponent:
            self.seat = self.rng.choice(["X", "O"]) if self.agent_seat == "random" else self.agent_seat
            if self.to_move != self.seat:
                self._play(self.rng.choice(empty_cells(self.board)))
        return {self.to_move: self._prompt()}

    def step(self, actions):
        mover = self.to_move
        text = actions.get(mover, "")
        self.moves += 1
        found = _INT.search(text)
        cell = int(found.group()) if found and len(found.group()) <= 3 else None
        if cell is None or cell not in empty_cells(self.board):
            reason = ("no cell number in the reply" if found is None else
                      f"cell {found.group()[:12]} is not an empty cell (empty: {empty_cells(self.board)})")
            return self._end({mover: -1.0, other(mover): 1.0}, {mover: {"invalid": True, "reason": reason}})
        self.legal += 1
        self._play(cell)
        if (done := self._outcome()) is not None:
            return self._end(done, {})
        if self.opponent:  # the environment's own seat answers at once
            self._play(self.rng.choice(empty_cells(self.board)))
            if (done := self._outcome()) is not None:
                return self._end(done, {})
        return StepResult(prompts={self.to_move: self._prompt()}, reward={"X": 0.0, "O": 0.0})

    def episode_info(self):
        info = {"legal_move_rate": self.legal / max(1, self.moves), "moves": float(self.moves)}
        if self.opponent:
            mine = (self.result or {}).get(self.seat, 0.0)
            info.update(win=float(mine > 0), draw=float(self.result is not None and mine == 0), loss=float(mine < 0),
                        success=float(mine > 0))
        return info

    # --------------------------------------------------------------------------------- helpers
    def _play(self, cell: int) -> None:
        self.board[cell - 1] = self.to_move
        self.to_move = other(self.to_move)

    def _outcome(self) -> dict[str, float] | None:
        side = winner(self.board)
        if side:
            return {side: 1.0, other(side): -1.0}
        if not empty_cells(self.board):
            return {"X": 0.0, "O": 0.0}
        return None

    def _end(self, reward: dict[str, float], infos) -> StepResult:
        self.result = reward
        return StepResult(prompts={}, reward=reward, terminated=True, infos=infos)

    def _prompt(self) -> str:
        cells = ", ".join(map(str, empty_cells(self.board)))
        return (f"You are playing tic-tac-toe as {self.to_move}. Get three {self.to_move}s in a row to win. "
                f"The board (empty cells show their number):\n{render(self.board)}\n"
                f"Empty cells: {cells}.\nReply with just the number of the empty cell you play.")


def make_dataset(n: int = 64, max_opening_moves: int = 2, seed: int = 0, split: str = "train") -> datasets.Dataset:
    """`n` openings: boards with 0..max_opening_moves random moves played (X first), drawn with a fixed seed. `split`: "train" or "eval", a fixed partition of the
    possible openings (about one in five is held out for evaluation), so no evaluation sample is a training one.
    The empty board is a training opening."""
    rng = random.Random(seed)
    rows = []
    for _ in range(1000 * n):
        if len(rows) == n:
            break
        board = ["."] * 9
        for k in range(rng.randint(0, max_opening_moves)):
            board[rng.choice([i for i in range(9) if board[i] == "."])] = "XO"[k % 2]
            if winner(board):  # keep openings undecided (only possible with max_opening_moves >= 5)
                board = ["."] * 9
                break
        key = "".join(board)
        if in_split(key, split) and (split == "train" or "X" in key):
            rows.append({"board": key})
    return datasets.Dataset.from_list(rows)


def sample_action(role: str, prompt, rng: random.Random) -> str:
    """A legal random move: one of the empty cells the prompt lists."""
    match = re.search(r"Empty cells: ([0-9, ]+)\.", prompt if isinstance(prompt, str) else prompt[-1]["content"])
    cells = [int(c) for c in match.group(1).split(",")] if match else [5]
    return str(rng.choice(cells))
