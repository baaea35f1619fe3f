"""Describe and guess: a describer and a guesser, two distinct agents, share one reward.

Turn 1: the describer gets a secret word and describes it in a sentence. Turn 2: the guesser reads the
description and picks the word from four options. The team scores 1.0 when the guesser's reply names
the secret word and no other option, else 0: the reward needs both, a description that singles the word
out and a guess that reads it.

The describer may not say the word: every occurrence of it (any case, plural included) is replaced by
`___` before the guesser reads the description, so a description that leans on the word carries nothing.
Other ways of conveying it are plays of the game, as in Taboo (a synonym, a rhyme, spelling it out);
only the guess is scored. The describer never sees the options.

The held-out split is words: evaluation rows draw the secret word and all three distractors from
`HELD_OUT`, 48 words no training row uses in any role. Describing an unseen word so that it can be
told apart, and picking the option a description fits, are rules that transfer; a table does not.

episode_info: `guess_correct` (also `success`), `said_word` (the description named the word, masked),
`named_options` (how many options the guess named: 1 is a clean answer).
"""

from __future__ import annotations

import random
import re

import datasets

from protocols.env import Environment, StepResult

TRAIN = ("apple banana bread cheese egg lemon milk orange cake rice soup tea "
         "cat dog horse cow sheep lion tiger mouse rabbit fish bird snake duck bear "
         "chair table bed door window lamp sofa mirror carpet pillow "
         "car bus train boat plane bicycle truck rocket "
         "book pen phone clock key hat shoe shirt cup spoon knife ball candle umbrella "
         "sun moon star rain snow tree flower river mountain ocean").split()
HELD_OUT = ("carrot grape honey pizza frog monkey elephant owl whale shark "
            "desk oven fork bottle glove sock ladder kite violin drum "
            "cloud island volcano desert "
            "potato tomato cookie butter peach onion penguin turtle camel zebra spider bee "
            "bucket hammer brush basket piano guitar helmet wallet towel tent forest beach").split()
MASK = "___"
OPTIONS = 4


def _pattern(word: str) -> re.Pattern:
    """The word and its plural, whole, in any case."""
    return re.compile(rf"\b{re.escape(word)}(?:s|es)?\b", re.IGNORECASE)


def mask(description: str, word: str) -> str:
    return _pattern(word).sub(MASK, description)


def named(reply: str, options: list[str]) -> list[str]:
    """The options the reply names, in option order."""
    return [option for option in options if _pattern(option).search(reply)]


class GuessEnv(Environment):
    possible_agents = ["describer", "guesser"]
    max_turns = 2

    def reset(self, sample, seed=None):
        self.word, self.options = sample["word"], list(sample["options"])
        self.said_word, self.picked = False, []
        return {"describer": f"We are playing a guessing game. Describe a {self.word} in one short sentence, "
                             f"without saying the word \"{self.word}\"."}

    def step(self, actions):
        if "describer" in actions:
            description = " ".join(actions["describer"].split())
            self.said_word = bool(_pattern(self.word).search(description))
            shown = mask(description, self.word) or "(nothing)"
            infos = {} if description else {"describer": {"invalid": True, "reason": "empty description"}}
            return StepResult(prompts={"guesser": f"Options: {', '.join(self.options)}.\nClue: {shown}\n"
                                                  f"Which option fits the clue? The answer is one of the options:"},
                              reward=0.0, infos=infos)
        self.picked = named(actions.get("guesser", ""), self.options)
        infos = {} if self.picked else {"guesser": {"invalid": True, "reason": "named none of the options"}}
        return StepResult(prompts={}, reward=float(self.picked == [self.word]), terminated=True, infos=infos)

    def episode_info(self):
        right = float(self.picked == [self.word])
        return {"guess_correct": right, "success": right, "said_word": float(self.said_word),
                "named_options": float(len(self.picked))}


def make_dataset(split: str = "train", n: int = 256, seed: int = 0) -> datasets.Dataset:
    """`n` rows of one split (`train`, or `eval`: the held-out words), each word of the split in turn as the
    secret `word`, with `options`: the word and three other words of the same split, shuffled."""
    words = {"train": TRAIN, "eval": HELD_OUT}.get(split)
    if words is None:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(seed)
    order = list(words)
    rows = []
    for i in range(n):
        if i % len(order) == 0:
            rng.shuffle(order)
        word = order[i % len(order)]
        options = [word, *rng.sample([w for w in words if w != word], OPTIONS - 1)]
        rng.shuffle(options)
        rows.append({"word": word, "options": options})
    return datasets.Dataset.from_list(rows)


def sample_action(role: str, prompt, rng: random.Random) -> str:
    """A random play (what `marsi validate`'s trial episode plays): a few words of the prompt as a
    description; for the guesser, one of the options listed in its prompt."""
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    if role == "guesser":
        listed = re.search(r"Options: (.*)\.\n", text)
        return rng.choice(listed.group(1).split(", ")) if listed else ""
    return " ".join(rng.sample(text.split(), 4))
