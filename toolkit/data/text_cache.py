"""Text conditioning of a batch: captions processed and encoded live, or taken from a cache.

Both sources draw each sample's caption view (caption and token dropout, segment shuffling) with the same plan
(`plan_caption_view`) from the same generator, keyed by (seed, "caption", epoch, sample): live captions join the
planned segments and encode the text, cached ones move the planned segments' token positions of the cached
embedding. So a resumed run sees exactly the captions an uninterrupted one saw, and a cached run the token
sequences a live one sees (as far as the tokenizer allows: `view_positions`). A cached view that is the whole
caption (no segment dropped or moved) is the entry as written; only views that move or drop segments need the
entry's segment spans (`segment_spans`).

Families whose text encoder reads each sample's reference images with its caption (Qwen-Image-Edit, `in_text`): an
entry is one per (caption, references as the sample shows them): its key adds each reference file's digest and the
variant's place and mirrors (`reference_key`); every variant a dataset can draw is encoded when the cache is built
(the config refuses random crops and moved segments for them with a cache), the blank prompt with each sample's
references where its dataset drops captions.
"""

from __future__ import annotations

import hashlib
import logging
from functools import lru_cache
from itertools import pairwise
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from toolkit.config.sections import DatasetConfig
from toolkit.data.captions import (
    canonical_caption,
    join_segments,
    plan_caption_view,
    process_caption,
    segment_ranges,
    split_segments,
)
from toolkit.data.dataset import ImageDataset, Variant, batch_of, centre_variant, reference_views
from toolkit.data.latent_cache import file_digest
from toolkit.errors import UserError
from toolkit.files import write_atomic
from toolkit.models.base import ModelAdapter, PromptEmbeds, TextRules, join_padded
from toolkit.run.metrics import progress_bars_wanted
from toolkit.train.seeding import seeded_generator

log = logging.getLogger("difftune")
BLANK = ""
RECENT_ENTRIES = 128  # cached prompts kept in memory (an SD 1.x entry is about 240 KB)


class SegmentsUnknown(UserError, ValueError):
    """A cached caption whose views move or drop segments, but whose segments cannot be told in the text the family's
    text encoder reads; the message names the caption file and what to do."""


class LiveCaptions:
    """Caption processing (shuffle, dropouts) each epoch, then the text encoder, for every micro-batch."""

    def __init__(self, adapter: ModelAdapter, dataset: ImageDataset, cfgs: list[DatasetConfig], seed: int,
                 trigger_word: str | None):
        self.adapter, self.dataset, self.cfgs, self.seed, self.trigger_word = adapter, dataset, cfgs, seed, trigger_word
        #: each dataset's caption-view keys, and whether its views draw anything
        self.settings = [view_settings(cfg) for cfg in cfgs]
        self.fixed = [not draws_views(cfg) for cfg in cfgs]
        #: the one view of each sample whose dataset draws none (the same text every epoch), made when first asked for
        self.fixed_views: dict[int, str] = {}

    def start_epoch(self, epoch: int) -> None:
        pass

    def caption(self, index: int, epoch: int) -> str:
        """The sample's caption view this epoch; where its dataset draws nothing (no dropout, no shuffle) the view is
        the same every epoch, made once."""
        item = self.dataset.items[index]
        if not self.fixed[item.dataset]:
            return self.view(item.record.caption, item.dataset, seeded_generator(self.seed, "caption", epoch, index))
        if index not in self.fixed_views:
            self.fixed_views[index] = self.view(item.record.caption, item.dataset, torch.Generator())
        return self.fixed_views[index]

    def view(self, caption: str, dataset: int, generator: torch.Generator) -> str:
        return process_caption(caption, generator, **self.settings[dataset], trigger_word=self.trigger_word,
                               blank=BLANK)

    def embeds_for(self, indices: list[int], epoch: int) -> PromptEmbeds:
        captions = [self.caption(i, epoch) for i in indices]
        if not reads_references(self.adapter):
            return self.adapter.encode_prompts(captions)
        return self.adapter.encode_prompts(captions, [self.reference_views(i, epoch) for i in indices])

    def reference_views(self, index: int, epoch: int) -> list:
        """The sample's reference pictures as it shows them this epoch (`reference_views`), for a text encoder that
        reads them with the caption."""
        return reference_views(self.dataset.items[index], self.dataset.variant(index, epoch),
                               self.adapter.reference_rules)


def reads_references(adapter: ModelAdapter) -> bool:
    """Whether the family's text encoder reads each sample's reference images with its prompt (Qwen-Image-Edit)."""
    rules = adapter.reference_rules
    return rules is not None and rules.in_text


def view_settings(cfg: DatasetConfig) -> dict:
    """A dataset's caption-view keys, as both caption sources hand them to the plan."""
    return {"shuffle": cfg.shuffle_tokens, "keep_tokens": cfg.keep_tokens,
            "caption_dropout_rate": cfg.caption_dropout_rate, "token_dropout_rate": cfg.token_dropout_rate}


def draws_views(cfg: DatasetConfig) -> bool:
    """Whether a dataset's caption views draw from their generator (`plan_caption_view` draws for caption dropout,
    token dropout and shuffling only): without any, every view of a caption is the same."""
    return bool(cfg.shuffle_tokens or cfg.caption_dropout_rate or cfg.token_dropout_rate)


def offset_token_spans(tokenizer, text: str, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[first, stop) token indices of each character range of `text`, by a fast tokenizer's character offsets: a
    token belongs to the first range its characters overlap, a range taken with the spaces before it (so the space
    before a word belongs to the word's segment, whether the tokenizer joins it to the word's token, as byte-level
    BPE does, or gives it a token of its own); tokens overlapping none (commas) are separators. A range without a
    token of its own gets an empty span where it stands."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
    spaced = [(len(text[:start].rstrip()), stop) for start, stop in ranges]
    owners = [next((k for k, (start, stop) in enumerate(spaced) if a < stop and b > start), None) for a, b in offsets]
    spans, last = [], 0
    for k in range(len(ranges)):
        owned = [i for i, owner in enumerate(owners) if owner == k]
        spans.append((owned[0], owned[-1] + 1) if owned else (last, last))
        last = spans[-1][1]
    return spans


def prefix_token_spans(tokenizer, text: str, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The same for tokenizers without character offsets (slow ones): each range starts after the tokens of the
    text before it (the spaces before the range left to the range) and stops after the tokens of the text up to
    its end."""

    def count(prefix: str) -> int:
        return len(tokenizer(prefix, add_special_tokens=False).input_ids)

    return [(count(text[:start].rstrip()), count(text[:stop])) for start, stop in ranges]


def encoder_segments(rules: TextRules, caption: str) -> tuple[str, list[tuple[int, int]]] | None:
    """The text the family's tokenizer reads for `caption` (`encoder_text` of the whole caption, as `encode_prompts`
    cleans it) and the [start, stop) character range in it of each comma-separated segment of `caption`
    (`split_segments`); None where they cannot be told.

    Each segment is cleaned alone and the cleaned segments are joined with ", ": where that is the whole caption's
    cleaned text, each segment's range is where its cleaned text stands, commas the cleaning made inside a segment
    (Wan: "&#44;", a full-width "，" that ftfy turns into ",") included, so the segment count never changes. A live
    view joins its segments with ", " and cleans the whole, which (the cleaning being the same segment by segment)
    is the cleaned segments joined in the view's order: the tokens the cached view moves. Otherwise (a caption not
    written as `canonical_caption` writes it) the cleaned text's own comma-separated segments are taken where they
    are the cleaned segments; else (a cleaning that reads across commas) None."""
    text = rules.encoder_text(caption)
    cleaned = [rules.encoder_text(segment) for segment in split_segments(caption)]
    if join_segments(cleaned) == text:
        ranges, start = [], 0
        for segment in cleaned:
            ranges.append((start, start + len(segment)))
            start += len(segment) + 2  # ", "
        return text, ranges
    ranges = segment_ranges(text)
    return (text, ranges) if [text[start:stop] for start, stop in ranges] == cleaned else None


def segment_spans(rules: TextRules, caption: str, length: int) -> torch.Tensor | None:
    """[segments, 2] int64: the [first, stop) positions of each comma-separated segment of `caption`
    (`split_segments`) in its embeddings (`length` tokens) from `encode_prompts`, found in the text the tokenizer
    reads (`encoder_segments`); None where the segments cannot be told there. A segment cut off by the encoder's
    length limit is clipped (to nothing when it starts after the limit)."""
    found = encoder_segments(rules, caption)
    if found is None:
        return None
    text, ranges = found
    tokenizer = rules.tokenizer
    find = offset_token_spans if tokenizer.is_fast else prefix_token_spans
    first, stop = rules.caption_token_span(length)
    spans = torch.tensor(find(tokenizer, text, ranges), dtype=torch.int64).reshape(-1, 2)
    return (spans + first).clamp(max=stop)


def view_positions(spans: torch.Tensor, order: tuple[int, ...], caption_span: tuple[int, int], length: int,
                   row_length: int, keep_length: bool) -> tuple[torch.Tensor, int]:
    """The positions of a cached embedding row ([row_length, dim], `length` real tokens, its segments at `spans`)
    that make one caption view (segments `order`), and how many of them are real tokens.

    In order: the positions before the caption (start token, template head); each planned segment's positions with
    a comma between two segments; the positions after the caption (end token, template tail). The commas are the
    caption's own comma positions, taken in order (the space after a comma belongs to the next segment). A segment
    whose last token holds the comma after it too (CLIP's and byte-level BPE's `),`) brings that comma along: no
    other follows it, and when it ends up last the view ends with its comma while the comma before it is the
    previous one again. With `keep_length` (fixed-length families) the row keeps its length: the row's own padding
    positions follow the real ones, then its last position again for the positions dropped segments freed (and a
    full row is cut at the caption's end, as the encoder cuts); otherwise the row ends with its real tokens.

    For CLIP, T5 and byte-level BPE tokenizers this is the live view's token sequence but where docs/models.md
    ("Caption views") says otherwise. The embeddings are the cached rows moved, each still computed in the whole
    caption's context.
    """
    bounds = spans.tolist()
    gaps = [range(before[1], after[0]) for before, after in pairwise(bounds)]
    # a segment brings its comma when its last token is followed directly by the next (present) segment's tokens
    brings_comma = [not gap and after[0] < after[1] for gap, after in zip(gaps, bounds[1:])] + [False]
    commas = [gap for gap in gaps if gap]
    present = [k for k in order if bounds[k][0] < bounds[k][1]]  # a segment cut off by the encoder is in no view
    body: list[int] = []
    comma = range(0)
    for j, k in enumerate(present):
        if j and not brings_comma[present[j - 1]]:
            comma = commas.pop(0) if commas else comma
            body.extend(comma)
        body.extend(range(*bounds[k]))
    caption_first, caption_stop = caption_span
    head, tail = list(range(caption_first)), list(range(caption_stop, length))
    if keep_length:
        body = body[:row_length - len(head) - len(tail)]
    used = head + body + tail
    real = len(used)
    if keep_length:
        used += [min(position, row_length - 1) for position in range(length, length + row_length - real)]
    return torch.tensor(used, dtype=torch.int64), real


class CachedCaptions:
    """One cached embedding per distinct caption (plus the blank prompt); the text encoder can leave. An entry
    encodes the caption as its whole view is written (`canonical_caption`), with its segments' token spans where
    they can be told (`segment_spans`). Only datasets that move or drop segments (`shuffle_tokens`,
    `token_dropout_rate`) need them: for their captions `build` checks first that they can be told, and names the
    caption file otherwise (`SegmentsUnknown`); an entry written without them gets them from its caption when a view
    first needs them. `device`: where the embeddings go (the training device; the adapter's where not given, which
    finding its first weight makes a walk of the module per micro-batch)."""

    def __init__(self, adapter: ModelAdapter, dataset: ImageDataset, cfgs: list[DatasetConfig], seed: int,
                 trigger_word: str | None, roots: dict[int, Path], device: torch.device | None = None):
        self.adapter, self.dataset, self.cfgs, self.seed, self.trigger_word = adapter, dataset, cfgs, seed, trigger_word
        self.device = device
        self.identity = adapter.encoder_identity("text")
        self.roots = roots
        self._recent = lru_cache(maxsize=RECENT_ENTRIES)(self._read)
        self.own_keys: dict[int, str] = {}
        #: the text encoder reads each sample's references with its caption: entries are per caption and references
        self.with_references = reads_references(adapter)
        self._digests: dict[Path, str] = {}
        self.folder_of = {BLANK: roots[0]}
        for item in dataset.items:
            self.folder_of.setdefault(canonical_caption(item.record.caption), roots[item.dataset])
        if trigger_word:
            self.folder_of.setdefault(canonical_caption(trigger_word), roots[0])
        #: entry key -> (caption, a sample and variant whose references it reads), where entries read references
        self.readers: dict[str, tuple[str, int, Variant]] = {}
        if self.with_references:
            self.plan_reference_entries()

    def path(self, key: str) -> Path:
        digest = hashlib.sha256(f"{self.identity}|{key}".encode()).hexdigest()[:32]
        return self.folder_of[key] / "text" / f"{digest}.safetensors"

    def entry_key(self, caption: str, references: str) -> str:
        """The key of a caption's entry read with references (`reference_key`; "" for none: the caption itself)."""
        return f"{caption}\x00{references}" if references else caption

    def reference_key(self, index: int, variant: Variant) -> str:
        """What the text encoder is shown of a sample's references: each file's digest, the target's bucket and the
        variant's crop and mirrors (its references' windows follow from them); "" where the family reads none."""
        item = self.dataset.items[index]
        if not self.with_references or not item.record.references:
            return ""
        digests = ",".join(self.digest(reference.path) for reference in item.record.references)
        return (f"{digests}|{item.bucket[0]}x{item.bucket[1]}|{variant.left},{variant.top}|"
                f"{int(variant.flip_x)}{int(variant.flip_y)}")

    def digest(self, path: Path) -> str:
        if path not in self._digests:
            self._digests[path] = file_digest(path)
        return self._digests[path]

    def drawable_variants(self, index: int) -> list[Variant]:
        """Every variant of a sample its dataset can draw, where its crop is fixed (the config refuses random crops
        here): the centre, mirrored as its flips allow."""
        item = self.dataset.items[index]
        options, centre = self.dataset.options_for(item.dataset), centre_variant(item)
        return [Variant(centre.left, centre.top, flip_x, flip_y) for flip_x in (False, True)[:1 + options.flip_x]
                for flip_y in (False, True)[:1 + options.flip_y]]

    def plan_reference_entries(self) -> None:
        """The entries of a family that reads references: each sample's caption (and the blank prompt where its
        dataset drops captions) with each variant of its references."""
        for index, item in enumerate(self.dataset.items):
            caption = self.own_key(index)
            captions = [caption] + ([BLANK] if self.cfgs[item.dataset].caption_dropout_rate else [])
            for variant in self.drawable_variants(index):
                references = self.reference_key(index, variant)
                for text in captions:
                    key = self.entry_key(text, references)
                    if key not in self.readers:
                        self.readers[key] = (text, index, variant)
                        self.folder_of.setdefault(key, self.folder_of[text])

    def moves_segments(self, index: int) -> bool:
        """Whether a sample's caption views may drop or move segments (its dataset shuffles or drops them), so that
        its cached entry needs segment spans; caption dropout alone does not (its view is the blank prompt)."""
        cfg = self.cfgs[self.dataset.items[index].dataset]
        return cfg.shuffle_tokens or cfg.token_dropout_rate > 0

    def build(self, accelerator, batch_size: int = 16) -> None:
        """Encode the captions not yet on disk, shared out across processes."""
        checked = set()
        for index in range(len(self.dataset)):
            key = self.own_key(index)  # an uncachable sample fails here, before any encoding
            if self.moves_segments(index) and key not in checked:  # so does a caption whose segments are unknown
                if encoder_segments(self.adapter.text, key) is None:
                    raise self.segments_unknown(key, index)
                checked.add(key)
        captions = sorted(self.readers) if self.with_references else sorted(self.folder_of)
        mine = [c for c in captions[accelerator.process_index :: accelerator.num_processes] if not self.path(c).is_file()]
        if accelerator.is_main_process:
            log.info("text-embedding cache: %d captions, %d to encode", len(captions), len(mine))
        chunks = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
        shown = accelerator.is_main_process and chunks and progress_bars_wanted()
        for chunk in tqdm(chunks, desc="caching text embeddings", disable=not shown):
            embeds = self.encode(chunk)
            for row, key in enumerate(chunk):
                self.write(key, embeds, row)
        accelerator.wait_for_everyone()

    def encode(self, keys: list[str]) -> PromptEmbeds:
        """Entries' prompts encoded together: their captions, and where the family reads references, each one's
        references as its sample's variant shows them."""
        if not self.with_references:
            return self.adapter.encode_prompts(keys)
        readers = [self.readers[key] for key in keys]
        return self.adapter.encode_prompts(
            [caption for caption, _, _ in readers],
            [reference_views(self.dataset.items[index], variant, self.adapter.reference_rules)
             for _, index, variant in readers])

    def write(self, key: str, embeds: PromptEmbeds, row: int) -> None:
        # where prompts keep their own length, the entry holds the prompt's own tokens, not its batch's padding
        end = int(embeds.lengths[row]) if self.adapter.text.variable_length else None
        tensors = {"embeds": embeds.embeds[row, :end].cpu().contiguous()}
        if embeds.attention_mask is not None:
            tensors["attention_mask"] = embeds.attention_mask[row, :end].cpu().contiguous()
        tensors["length"] = embeds.lengths[row].reshape(1).cpu()
        if embeds.pooled is not None:
            tensors["pooled"] = embeds.pooled[row].cpu().contiguous()
        if not self.with_references:  # (the config refuses moved segments where the references are read too)
            spans = segment_spans(self.adapter.text, key, int(embeds.lengths[row]))
            if spans is not None:  # kept where they can be told, for any dataset that shuffles this caption
                tensors["segment_spans"] = spans
        write_atomic(self.path(key), lambda tmp: save_file(tensors, str(tmp)))

    def load(self, caption: str) -> dict[str, torch.Tensor]:
        """A cached entry; the most used ones (blank prompt, trigger word, frequent captions) stay in
        memory instead of being read from disk for every micro-batch."""
        return self._recent(caption)

    def _read(self, caption: str) -> dict[str, torch.Tensor]:
        path = self.path(caption)
        try:
            entry = load_file(str(path))
        except Exception as err:
            raise RuntimeError(f"cached text embedding {path} is unreadable ({err}); delete the cache folder "
                               "to rebuild it") from err
        return entry

    def spans(self, key: str, entry: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        """The entry's segment spans; an entry written without them (before entries stored them, or for a caption
        whose segments could not be told) gets them from its caption now, kept with the entry in memory."""
        spans = entry.get("segment_spans")
        if spans is None:
            spans = segment_spans(self.adapter.text, key, int(entry["length"]))
            if spans is None:
                raise self.segments_unknown(key, index)
            entry["segment_spans"] = spans
        return spans

    def segments_unknown(self, key: str, index: int) -> SegmentsUnknown:
        item = self.dataset.items[index]
        text = self.adapter.text.encoder_text(key)
        return SegmentsUnknown(
            f"{item.record.path}: the caption {key!r} is read by the text encoder as {text!r}, whose "
            "comma-separated segments cannot be matched to the caption's (cleaning it for the encoder changes it "
            f"across its commas), so datasets[{item.dataset}].shuffle_tokens / token_dropout_rate cannot move or "
            "drop its cached segments. Write the caption's commas as plain commas (no html entity or full-width "
            "comma next to one), or set train.cache_text_embeddings: false (captions are then encoded live)"
        )

    def start_epoch(self, epoch: int) -> None:
        pass

    def own_key(self, index: int) -> str:
        """The cached entry of a sample's own caption; the trigger word's for a sample without one (found once per
        sample: a sample's caption does not change during a run)."""
        key = self.own_keys.get(index)
        if key is None:
            key = self.own_keys[index] = self.find_own_key(index)
        return key

    def find_own_key(self, index: int) -> str:
        item = self.dataset.items[index]
        if item.record.caption:
            return canonical_caption(item.record.caption)
        if self.cfgs[item.dataset].is_reg:
            return BLANK
        if self.trigger_word:
            return canonical_caption(self.trigger_word)
        raise ValueError(
            f"{item.record.path} has an empty caption, so there is no cached text embedding for it; give it a "
            f"caption file, set datasets[{item.dataset}].default_caption, or set trigger_word (an empty caption "
            "trains on the blank prompt only on is_reg datasets)"
        )

    def view(self, index: int, epoch: int) -> dict[str, torch.Tensor]:
        """A sample's caption view this epoch as a cached entry, planned as the live path plans it: the blank
        prompt's entry when caption dropout hits, else its own entry with the planned segments' token positions
        moved (`view_positions`), its mask and length to match; the pooled embedding stays the whole caption's."""
        key = self.own_key(index)
        cfg = self.cfgs[self.dataset.items[index].dataset]
        references = self.reference_key(index, self.dataset.variant(index, epoch)) if self.with_references else ""
        if not draws_views(cfg):  # every view is the whole caption: the entry as written
            return dict(self.load(self.entry_key(key, references)))
        segments = split_segments(key)
        plan = plan_caption_view(segments, seeded_generator(self.seed, "caption", epoch, index),
                                 **view_settings(cfg), trigger_word=self.trigger_word)
        if plan.blank:
            return self.load(self.entry_key(BLANK, references))
        entry = self.load(self.entry_key(key, references))
        if plan.order == tuple(range(len(segments))):  # the whole caption: the entry as written, no spans needed
            return dict(entry)
        embeds, length = entry["embeds"], int(entry["length"])
        rules = self.adapter.text
        positions, real = view_positions(self.spans(key, entry, index), plan.order, rules.caption_token_span(length),
                                         length, embeds.shape[0], keep_length=not rules.variable_length)
        view = {**entry, "embeds": embeds[positions], "length": entry["length"].new_tensor([real])}
        if "attention_mask" in entry:
            view["attention_mask"] = entry["attention_mask"][positions]
            view["attention_mask"][real:] = False
        return view

    def embeds_for(self, indices: list[int], epoch: int) -> PromptEmbeds:
        views = [self.view(index, epoch) for index in indices]
        device = self.device or self.adapter.device
        if len(views) == 1:  # a batch of one row: nothing to stack or pad
            view = views[0]
            mask, pooled = view.get("attention_mask"), view.get("pooled")
            return PromptEmbeds(view["embeds"].unsqueeze(0), None if mask is None else mask.unsqueeze(0),
                                view["length"], None if pooled is None else pooled.unsqueeze(0)).to(device)
        if len({v["embeds"].shape for v in views}) == 1:  # one length (always, where prompts are padded): stacked
            embeds = batch_of([v["embeds"] for v in views])
            masks = [v.get("attention_mask") for v in views]
            mask = batch_of(masks) if all(m is not None for m in masks) else None
        else:
            embeds, mask = join_padded([v["embeds"].unsqueeze(0) for v in views],
                                       [v["attention_mask"].unsqueeze(0) if "attention_mask" in v else None
                                        for v in views])
        length = torch.cat([v["length"] for v in views])  # host, read only
        pooled = batch_of([v["pooled"] for v in views]) if all("pooled" in v for v in views) else None
        return PromptEmbeds(embeds, mask, length, pooled).to(device)
