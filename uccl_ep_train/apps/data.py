"""The main job's training text: a generated corpus, byte-tokenised, so it needs no download.

The text is produced by a small deterministic grammar (sentences about objects, colours and counting),
regular enough for a tiny model to learn within a few hundred steps on CPU ranks, varied enough that the
loss starts near ln(vocab) and falls visibly.
"""
from __future__ import annotations

import random

import torch

_NOUNS = ["cat", "dog", "bird", "fish", "tree", "river", "stone", "house", "cloud", "train", "expert", "token"]
_ADJS = ["red", "blue", "green", "small", "large", "quick", "slow", "bright", "dark", "quiet"]
_VERBS = ["sees", "follows", "carries", "finds", "routes", "sends", "holds", "meets"]


def corpus_text(num_sentences: int = 4000, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(num_sentences):
        kind = i % 3
        if kind == 0:
            lines.append(f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} "
                         f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}.")
        elif kind == 1:
            n = rng.randrange(1, 50)
            lines.append(f"{n} plus 1 is {n + 1}; {n} times 2 is {2 * n}.")
        else:
            noun = rng.choice(_NOUNS)
            lines.append(f"a {noun} is a {noun}, and every {noun} {rng.choice(_VERBS)} a {rng.choice(_NOUNS)}.")
    return "\n".join(lines) + "\n"


class ByteBatches:
    """Random windows of the byte-tokenised corpus: (tokens, labels) of shape [batch, seq]."""

    def __init__(self, text: str, seq_length: int, batch_size: int, seed: int) -> None:
        self.data = torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)
        if self.data.numel() <= seq_length + 1:
            raise ValueError(f"corpus of {self.data.numel()} bytes is too short for seq_length {seq_length}")
        self.seq_length, self.batch_size = seq_length, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.data.numel() - self.seq_length - 1, (self.batch_size,), generator=self.gen)
        window = torch.stack([self.data[s: s + self.seq_length + 1] for s in starts.tolist()])
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
