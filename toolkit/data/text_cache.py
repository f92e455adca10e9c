"""Text conditioning of a batch: captions processed and encoded live, or taken from a cache.

Both sources draw their per-sample randomness (caption dropout, shuffles) from generators keyed by
(seed, purpose, epoch, sample), so a resumed run sees exactly the captions an uninterrupted one saw.
"""

from __future__ import annotations

import hashlib
import logging
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from toolkit.config.sections import DatasetConfig
from toolkit.data.captions import process_caption
from toolkit.data.dataset import ImageDataset
from toolkit.files import write_atomic
from toolkit.models.base import ModelAdapter, PromptEmbeds, join_padded
from toolkit.run.metrics import progress_bars_wanted
from toolkit.train.seeding import seeded_generator

log = logging.getLogger("difftune")
BLANK = ""
RECENT_ENTRIES = 128  # cached prompts kept in memory (an SD 1.x entry is about 240 KB)


class LiveCaptions:
    """Caption processing (shuffle, dropouts) each epoch, then the text encoder, for every micro-batch."""

    def __init__(self, adapter: ModelAdapter, dataset: ImageDataset, cfgs: list[DatasetConfig], seed: int,
                 trigger_word: str | None):
        self.adapter, self.dataset, self.cfgs, self.seed, self.trigger_word = adapter, dataset, cfgs, seed, trigger_word

    def start_epoch(self, epoch: int) -> None:
        pass

    def caption(self, index: int, epoch: int) -> str:
        item = self.dataset.items[index]
        cfg = self.cfgs[item.dataset]
        return process_caption(
            item.record.caption, seeded_generator(self.seed, "caption", epoch, index),
            shuffle=cfg.shuffle_tokens, keep_tokens=cfg.keep_tokens, caption_dropout_rate=cfg.caption_dropout_rate,
            token_dropout_rate=cfg.token_dropout_rate, trigger_word=self.trigger_word, blank=BLANK,
        )

    def embeds_for(self, indices: list[int], epoch: int) -> PromptEmbeds:
        return self.adapter.encode_prompts([self.caption(i, epoch) for i in indices])


def permute_tokens(embeds: torch.Tensor, span: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """Shuffle the positions `span` = [first, stop) of one cached prompt ([tokens, dim]): the caption's own
    tokens. What comes before (start token, chat template) and after (end token, template, padding) stays."""
    first, stop = span
    inner = stop - first
    if inner < 2:
        return embeds
    order = torch.arange(embeds.shape[0])
    order[first:stop] = first + torch.randperm(inner, generator=generator)
    return embeds[order]


class CachedCaptions:
    """One cached embedding per distinct caption (plus the blank prompt); the text encoder can leave."""

    def __init__(self, adapter: ModelAdapter, dataset: ImageDataset, cfgs: list[DatasetConfig], seed: int,
                 trigger_word: str | None, roots: dict[int, Path]):
        self.adapter, self.dataset, self.cfgs, self.seed, self.trigger_word = adapter, dataset, cfgs, seed, trigger_word
        self.identity = adapter.encoder_identity("text")
        self.roots = roots
        self._recent = lru_cache(maxsize=RECENT_ENTRIES)(self._read)
        self.folder_of = {BLANK: roots[0]}
        for item in dataset.items:
            self.folder_of.setdefault(item.record.caption, roots[item.dataset])
        if trigger_word:
            self.folder_of.setdefault(trigger_word, roots[0])
        if any(cfg.shuffle_tokens for cfg in cfgs):
            log.warning("cached text embeddings: shuffle_tokens permutes the token positions of each cached "
                        "caption (start, end and padding stay), not its comma-separated segments; keep_tokens "
                        "does not apply and the trigger word moves too")

    def path(self, caption: str) -> Path:
        key = hashlib.sha256(f"{self.identity}|{caption}".encode()).hexdigest()[:32]
        return self.folder_of[caption] / "text" / f"{key}.safetensors"

    def build(self, accelerator, batch_size: int = 16) -> None:
        """Encode the captions not yet on disk, shared out across processes."""
        for index in range(len(self.dataset)):
            self.own_key(index)  # an uncachable sample fails here, before any encoding
        captions = sorted(self.folder_of)
        mine = [c for c in captions[accelerator.process_index :: accelerator.num_processes] if not self.path(c).is_file()]
        if accelerator.is_main_process:
            log.info("text-embedding cache: %d captions, %d to encode", len(captions), len(mine))
        chunks = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
        shown = accelerator.is_main_process and chunks and progress_bars_wanted()
        for chunk in tqdm(chunks, desc="caching text embeddings", disable=not shown):
            embeds = self.adapter.encode_prompts(chunk)
            for row, caption in enumerate(chunk):
                self.write(caption, embeds, row)
        accelerator.wait_for_everyone()

    def write(self, caption: str, embeds: PromptEmbeds, row: int) -> None:
        # where prompts keep their own length, the entry holds the prompt's own tokens, not its batch's padding
        end = int(embeds.lengths[row]) if self.adapter.text.variable_length else None
        tensors = {"embeds": embeds.embeds[row, :end].cpu().contiguous()}
        if embeds.attention_mask is not None:
            tensors["attention_mask"] = embeds.attention_mask[row, :end].cpu().contiguous()
        if embeds.lengths is not None:
            tensors["length"] = embeds.lengths[row].reshape(1).cpu()
        if embeds.pooled is not None:
            tensors["pooled"] = embeds.pooled[row].cpu().contiguous()
        write_atomic(self.path(caption), lambda tmp: save_file(tensors, str(tmp)))

    def load(self, caption: str) -> dict[str, torch.Tensor]:
        """A cached entry; the most used ones (blank prompt, trigger word, frequent captions) stay in
        memory instead of being read from disk for every micro-batch."""
        return self._recent(caption)

    def _read(self, caption: str) -> dict[str, torch.Tensor]:
        path = self.path(caption)
        try:
            return load_file(str(path))
        except Exception as err:
            raise RuntimeError(f"cached text embedding {path} is unreadable ({err}); delete the cache folder "
                               "to rebuild it") from err

    def start_epoch(self, epoch: int) -> None:
        if any(cfg.shuffle_tokens for cfg in self.cfgs):
            log.info("epoch %d: cached caption tokens are shuffled for this epoch", epoch)

    def own_key(self, index: int) -> str:
        """The cached entry of a sample's own caption; the trigger word's for a sample without one."""
        item = self.dataset.items[index]
        if item.record.caption:
            return item.record.caption
        if self.cfgs[item.dataset].is_reg:
            return BLANK
        if self.trigger_word:
            return self.trigger_word
        raise ValueError(
            f"{item.record.path} has an empty caption, so there is no cached text embedding for it; give it a "
            f"caption file, set datasets[{item.dataset}].default_caption, or set trigger_word (an empty caption "
            "trains on the blank prompt only on is_reg datasets)"
        )

    def caption_key(self, index: int, epoch: int) -> str:
        """Which cached entry a sample uses this epoch: the blank prompt when caption dropout hits it."""
        rate = self.cfgs[self.dataset.items[index].dataset].caption_dropout_rate
        if rate and torch.rand((), generator=seeded_generator(self.seed, "caption", epoch, index)).item() < rate:
            return BLANK
        return self.own_key(index)

    def embeds_for(self, indices: list[int], epoch: int) -> PromptEmbeds:
        rows, masks, lengths, pooled = [], [], [], []
        for index in indices:
            key = self.caption_key(index, epoch)
            entry = self.load(key)
            embeds = entry["embeds"]
            cfg = self.cfgs[self.dataset.items[index].dataset]
            if cfg.shuffle_tokens and key != BLANK and "length" in entry:
                generator = seeded_generator(self.seed, "token_shuffle", epoch, index)
                embeds = permute_tokens(embeds, self.adapter.text.caption_token_span(int(entry["length"])), generator)
            rows.append(embeds)
            masks.append(entry.get("attention_mask"))
            lengths.append(entry.get("length"))
            pooled.append(entry.get("pooled"))
        embeds, mask = join_padded([row.unsqueeze(0) for row in rows],
                                   [m.unsqueeze(0) if m is not None else None for m in masks])
        length = torch.cat(lengths) if all(n is not None for n in lengths) else None
        pooled = torch.stack(pooled) if all(p is not None for p in pooled) else None
        return PromptEmbeds(embeds, mask, length, pooled).to(self.adapter.device)
