"""Token ids of prompts read before, kept: live text encoding tokenizes the same captions epoch after epoch.

A tokenizer's call costs tens to hundreds of microseconds of Python per batch (transformers' argument handling,
the batch encoding, the tensors), every micro-batch of a run that encodes its captions live; a caption that did not
change has the same ids every time. `TokenMemo` keeps each prompt's ids (truncated, without padding) and pads a
batch of them as the tokenizer would (its pad token, its padding side), so the ids and mask it gives are exactly
the tokenizer's own for the same call (tests/test_tokens.py holds each family's tokenizer to that).

Not in transformers: its tokenizers cache nothing per text (only the `tokenizers` BPE model caches words, below the
Python call that costs here).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

#: bytes of token ids kept per tokenizer call: a run with shuffled or dropped-out caption views makes a new prompt at
#: almost every micro-batch, so the least recently read go first (an id is 8 bytes: a 77-token CLIP prompt about
#: 0.7 KB, so tens of thousands of prompts)
KEPT_BYTES = 32 * 2**20


@dataclass
class Tokens:
    """A batch of token ids [batch, length] and its attention mask (1 on a prompt's tokens, 0 on padding), as the
    tokenizer's `input_ids` and `attention_mask` with `return_tensors="pt"`."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


class TokenMemo:
    """`tokenizer(prompts, max_length=..., truncation=True, padding=..., return_tensors="pt", **options)`, with each
    prompt's ids tokenized once. `pad_to_max`: every row `max_length` long (padding="max_length"); else rows as
    long as the batch's longest prompt (padding=True)."""

    def __init__(self, tokenizer: Any, max_length: int, pad_to_max: bool, kept: int = KEPT_BYTES, **options):
        if tokenizer.pad_token_id is None:
            raise ValueError(f"{type(tokenizer).__name__} has no pad token: its batches cannot be padded")
        self.tokenizer, self.max_length, self.pad_to_max, self.kept = tokenizer, max_length, pad_to_max, kept
        self.options = options
        self.ids: OrderedDict[str, array] = OrderedDict()
        self.used = 0

    def __call__(self, prompts: list[str]) -> Tokens:
        rows = self.prompt_ids(prompts)
        length = self.max_length if self.pad_to_max else max(len(row) for row in rows)
        pad, left = self.tokenizer.pad_token_id, self.tokenizer.padding_side == "left"
        ids, mask = [], []
        for row in rows:
            padding = length - len(row)
            ids.append([pad] * padding + row if left else row + [pad] * padding)
            mask.append([0] * padding + [1] * len(row) if left else [1] * len(row) + [0] * padding)
        return Tokens(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long))

    def prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        """Each prompt's ids, truncated to `max_length`, without padding; the prompts not kept are tokenized in one
        call (as the batch would have been) and kept."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self.ids))
        fresh: dict[str, array] = {}
        if missing:
            found = self.tokenizer(missing, max_length=self.max_length, truncation=True, padding=False,
                                   **self.options).input_ids
            fresh = {prompt: array("q", ids) for prompt, ids in zip(missing, found, strict=True)}
        rows = []
        for prompt in prompts:
            ids = fresh.get(prompt)
            if ids is None:
                ids = self.ids[prompt]
                self.ids.move_to_end(prompt)
            rows.append(ids.tolist())
        for prompt, ids in fresh.items():
            self.keep(prompt, ids)
        return rows

    def keep(self, prompt: str, ids: array) -> None:
        self.ids[prompt] = ids
        self.used += ids.itemsize * len(ids)
        while self.used > self.kept and len(self.ids) > 1:
            _, dropped = self.ids.popitem(last=False)
            self.used -= dropped.itemsize * len(dropped)


class TokenMemos:
    """An adapter's memos, one per tokenizer and call settings."""

    def __init__(self):
        self.memos: dict[tuple, TokenMemo] = {}

    def tokenize(self, tokenizer: Any, prompts: list[str], max_length: int, pad_to_max: bool, **options) -> Tokens:
        key = (id(tokenizer), max_length, pad_to_max, tuple(sorted(options.items())))
        memo = self.memos.get(key)
        if memo is None or memo.tokenizer is not tokenizer:
            memo = self.memos[key] = TokenMemo(tokenizer, max_length, pad_to_max, **options)
        return memo(prompts)
