"""A deterministic text corpus, generated in code so the demo needs no download.

Sentences come from a small grammar with a seeded generator: the same text on every
machine and every run, varied enough that a character-level model keeps learning for a
few hundred steps (spelling first, then word order, then agreement), structured enough
that the loss falls visibly within a demo. Batches are a pure function of the step, so a
resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import random

import torch

_SUBJECTS = (
    "the cat",
    "a dog",
    "the old sailor",
    "my sister",
    "the robot",
    "a small bird",
    "the teacher",
    "our neighbour",
    "the engineer",
    "a tired student",
)
_VERBS = (
    "sees",
    "likes",
    "follows",
    "paints",
    "builds",
    "finds",
    "carries",
    "remembers",
    "watches",
    "repairs",
)
_OBJECTS = (
    "the red boat",
    "a quiet garden",
    "the broken clock",
    "an empty box",
    "the tall tower",
    "a bright lamp",
    "the wooden bridge",
    "a green apple",
    "the long letter",
    "a silver key",
)
_PLACES = (
    "by the river",
    "in the morning",
    "under the stars",
    "near the station",
    "after the storm",
    "at the market",
    "before dinner",
    "in the snow",
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
    if rng.random() < 0.6:
        words.append(rng.choice(_PLACES))
    if rng.random() < 0.3:
        a, b = rng.randrange(10), rng.randrange(10)
        words.append(f"and counts {a} plus {b} is {a + b}")
    return " ".join(words) + ". "


def generate(n_chars: int = 200_000, seed: int = 1234) -> str:
    """About ``n_chars`` characters of text, always the same for the same arguments."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        sentence = _sentence(rng)
        parts.append(sentence.capitalize())
        size += len(sentence)
    return "".join(parts)


class Corpus:
    """The text as token ids (one per character) and the batch of each training step."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.index[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets for ``step``: depends on the step alone."""
        generator = torch.Generator().manual_seed(10_000 + step)
        starts = torch.randint(0, len(self.data) - seq_len - 1, (batch_size,), generator=generator)
        rows = starts[:, None] + torch.arange(seq_len + 1)
        window = self.data[rows]
        return window[:, :-1], window[:, 1:]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)
