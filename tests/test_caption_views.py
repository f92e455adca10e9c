"""Caption views: one plan (caption dropout, token dropout, segment shuffling) that live captions join as text and
cached text embeddings apply to the cached token positions, so both give the same token sequences."""

from __future__ import annotations

import html
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from helpers import make_image, trainer_process, write_job
from safetensors.torch import load_file, save_file

from toolkit.config.loader import load_config
from toolkit.config.schema import DatasetConfig
from toolkit.data.captions import plan_caption_view, process_caption, segment_ranges, split_segments
from toolkit.data.dataset import build_dataset
from toolkit.data.text_cache import (
    CachedCaptions,
    LiveCaptions,
    SegmentsUnknown,
    offset_token_spans,
    prefix_token_spans,
    segment_spans,
    view_positions,
)
from toolkit.errors import UserError
from toolkit.models.base import TextRules
from toolkit.models.qwen_image.adapter import PROMPT_TEMPLATE, TEMPLATE_DROP, QwenImageAdapter
from toolkit.models.registry import get_adapter_class, model_config
from toolkit.train.seeding import seeded_generator

CPU = torch.device("cpu")
SOLO = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True, wait_for_everyone=lambda: None)
SEGMENTS = ["a", "b", "c", "sks dog", "d", "e", "f"]
#: captions as read from caption files (the trigger word is prepended where a caption lacks it); the last two are
#: written otherwise than the live path writes its views (a trailing comma, no space after a comma)
CAPTIONS = ("red, round, shiny, small, outdoors", "a photo, sks dog, grass, sunny day, blue", "green",
            "blue sky, clouds,", "tree,bush ,  moss")
VIEW_KEYS = {"shuffle_tokens": True, "keep_tokens": 1, "token_dropout_rate": 0.3, "caption_dropout_rate": 0.2}


@pytest.fixture(scope="module")
def sd15(tiny_sd15):
    return get_adapter_class("sd15").load(model_config(arch="sd15", name_or_path="tiny"), CPU, torch.float32)


@pytest.fixture(scope="module")
def qwen(tiny_cache) -> QwenImageAdapter:
    return QwenImageAdapter.load(model_config(arch="qwen_image", name_or_path="tiny"), CPU, torch.float32)


# ---- the plan ---------------------------------------------------------------------------------------------------


def old_order(segments: list[str], generator: torch.Generator, rate: float, keep: int) -> tuple[int, ...] | None:
    """The view the plan must draw where no segment holds the trigger word, made straight from the generator:
    caption dropout, token dropout per segment after the kept ones, one permutation of the rest. None: blank."""
    if torch.rand((), generator=generator).item() < 0.2:
        return None
    rest = list(range(keep, len(segments)))
    draws = torch.rand(len(rest), generator=generator).tolist()
    rest = [i for i, draw in zip(rest, draws) if draw >= rate]
    if len(rest) > 1:
        rest = [rest[i] for i in torch.randperm(len(rest), generator=generator).tolist()]
    return tuple(range(keep)) + tuple(rest)


def test_plan_draws_in_the_old_order_where_no_trigger_is_involved():
    segments = [s for s in SEGMENTS if "sks" not in s]
    for index in range(300):
        expected = old_order(segments, seeded_generator(5, "caption", 2, index), rate=0.3, keep=2)
        view = plan_caption_view(segments, seeded_generator(5, "caption", 2, index), shuffle=True, keep_tokens=2,
                                 caption_dropout_rate=0.2, token_dropout_rate=0.3, trigger_word="sks")
        assert view.blank == (expected is None)
        assert view.order == (expected or ())
        text = process_caption(", ".join(segments), seeded_generator(5, "caption", 2, index), shuffle=True,
                               keep_tokens=2, caption_dropout_rate=0.2, token_dropout_rate=0.3, trigger_word="sks")
        assert text == ("" if expected is None else ", ".join(segments[i] for i in expected))


def test_plan_keeps_the_leading_segments_and_the_trigger_segment_in_place():
    orders = set()
    for index in range(300):
        view = plan_caption_view(SEGMENTS, seeded_generator(1, "caption", 0, index), shuffle=True, keep_tokens=2,
                                 token_dropout_rate=0.3, trigger_word="sks")
        order = view.order
        assert order[:2] == (0, 1)
        kept = sorted(order[2:])
        assert 3 in kept  # never dropped
        assert order[2 + kept.index(3)] == 3  # its slot among the kept segments
        orders.add(order)
    assert len(orders) > 40  # the other segments do move and drop


def test_segment_ranges_are_the_split_segments():
    for caption in ("a, b,c", " ,a ,, b , ", "", "one", "x,,", "(red), blue"):
        assert [caption[a:b] for a, b in segment_ranges(caption)] == split_segments(caption)
        assert split_segments(caption) == [s.strip() for s in caption.split(",") if s.strip()]


# ---- cached views against live captions -------------------------------------------------------------------------


def caption_sources(tmp_path, adapter, captions=CAPTIONS, **keys):
    for i, caption in enumerate(captions):
        make_image(tmp_path / "data" / f"img{i}.png", (64, 64), caption=caption)
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], **keys)
    dataset = build_dataset([cfg], "sks", adapter.divisor)
    cached = CachedCaptions(adapter, dataset, [cfg], seed=3, trigger_word="sks", roots={0: tmp_path / "cache"})
    cached.build(SOLO)
    return LiveCaptions(adapter, dataset, [cfg], seed=3, trigger_word="sks"), cached


def clip_ids(adapter, text: str) -> torch.Tensor:
    """The token ids sd15's `encode_prompts` encodes for `text` (padded and cut to 77)."""
    tokenizer = adapter.tokenizer
    return tokenizer(text, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids[0]


def qwen_ids(adapter, text: str) -> torch.Tensor:
    """The token ids of the rows Qwen-Image's `encode_prompts` gives `text` (the template's head dropped)."""
    return torch.tensor(adapter.tokenizer(PROMPT_TEMPLATE.format(text)).input_ids[TEMPLATE_DROP:])


def carrying_ids(cached: CachedCaptions, ids_of, monkeypatch) -> None:
    """Cached entries whose rows are [token id, position] of their caption's tokens, instead of the encoder's
    embeddings (segment spans, lengths and masks stay the entries' own): a view's rows then name the token ids
    and the cached positions it is made of."""
    real = cached.load

    def load(caption: str) -> dict[str, torch.Tensor]:
        entry = real(caption)
        ids = ids_of(caption)
        assert len(ids) == entry["embeds"].shape[0]
        return {**entry, "embeds": torch.stack([ids, torch.arange(len(ids))], dim=1)}

    monkeypatch.setattr(cached, "load", load)


def test_cached_views_are_the_live_token_sequences_with_clip(tmp_path, sd15, monkeypatch):
    live, cached = caption_sources(tmp_path, sd15, **VIEW_KEYS)
    stored = {key: cached.load(key) for key in cached.folder_of}
    real_views = {(i, epoch): cached.view(i, epoch) for i in range(len(CAPTIONS)) for epoch in range(6)}
    carrying_ids(cached, lambda caption: clip_ids(sd15, caption), monkeypatch)
    encoded = []
    monkeypatch.setattr(sd15, "encode_prompts", lambda prompts: encoded.append(prompts))
    seen = set()
    for (index, epoch), real in real_views.items():
        text = live.caption(index, epoch)
        view = cached.view(index, epoch)
        assert view["embeds"].shape == (77, 2) and int(view["length"]) == len(sd15.tokenizer(text).input_ids)
        assert torch.equal(view["embeds"][:, 0], clip_ids(sd15, text)), (index, epoch, text)
        # the real view is the cached rows at those positions: moved, not encoded again
        key = "" if text == "" else cached.own_key(index)
        assert torch.equal(real["embeds"], stored[key]["embeds"][view["embeds"][:, 1]])
        seen.add("blank" if text == "" else "shuffled" if text != ", ".join(split_segments(key)) else "whole")
    assert encoded == []
    assert seen == {"blank", "shuffled", "whole"}


def test_over_long_cached_captions_keep_what_fits_and_their_length(tmp_path, sd15, monkeypatch):
    words = [f"word{i}" for i in range(20)]  # a byte token per character: far over 77 tokens
    _, cached = caption_sources(tmp_path, sd15, captions=(", ".join(words),), shuffle_tokens=True)
    key = cached.own_key(0)
    spans = cached.load(key)["segment_spans"]
    assert spans[-1].tolist() == [76, 76]  # cut off: in no view
    tokenizer, orders = sd15.tokenizer, set()
    fits = tokenizer.decode(clip_ids(sd15, key), skip_special_tokens=True).replace(" ", "").split(",")
    assert fits[:3] == ["sks", "word0", "word1"] and fits[-1] == "word"  # word11, cut after "word"
    carrying_ids(cached, lambda caption: clip_ids(sd15, caption), monkeypatch)
    for epoch in range(4):
        view = cached.view(0, epoch)["embeds"]
        ids = view[:, 0].tolist()
        assert len(ids) == 77 and ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
        assert sorted(view[:, 1].tolist()) == list(range(77))  # the entry's rows, each once
        segments = tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "").split(",")
        assert sorted(segments) == sorted(fits)
        orders.add(tuple(segments))
    assert len(orders) > 1


def test_variable_length_views_shorten_rows_and_masks(tmp_path, qwen, monkeypatch):
    live, cached = caption_sources(tmp_path, qwen, **VIEW_KEYS)
    indices, epochs = list(range(len(CAPTIONS))), range(6)
    stored = {key: cached.load(key) for key in cached.folder_of}
    batches = [cached.embeds_for(indices, epoch) for epoch in epochs]
    real_views = {(i, epoch): cached.view(i, epoch) for i in indices for epoch in epochs}
    carrying_ids(cached, lambda caption: qwen_ids(qwen, caption), monkeypatch)
    shortened = 0
    for (index, epoch), real in real_views.items():
        text = live.caption(index, epoch)
        view = cached.view(index, epoch)
        ids = qwen_ids(qwen, text)
        # keep_tokens 1: the first segment stays first, so every segment keeps the leading space it was encoded with,
        # and the byte-level BPE sequence is the live one exactly
        assert torch.equal(view["embeds"][:, 0], ids), (index, epoch, text)
        key = "" if text == "" else cached.own_key(index)
        assert torch.equal(real["embeds"], stored[key]["embeds"][view["embeds"][:, 1]])
        length = len(ids)
        assert int(real["length"]) == length and real["attention_mask"].shape == (length,)
        assert real["attention_mask"].all()
        # in a batch: the row's own tokens, then padding the mask leaves out
        batch = batches[epoch]
        assert int(batch.lengths[index]) == length and torch.equal(batch.embeds[index, :length], real["embeds"])
        assert batch.attention_mask[index, :length].all() and not batch.attention_mask[index, length:].any()
        shortened += 0 < length < stored[key]["embeds"].shape[0]
    assert shortened > 0


# ---- spans -----------------------------------------------------------------------------------------------------


def test_segment_spans_hold_each_segments_tokens(tmp_path, sd15, qwen):
    for adapter, ids_of in ((sd15, clip_ids), (qwen, qwen_ids)):
        _, cached = caption_sources(tmp_path / adapter.arch, adapter, captions=("a photo, sks dog, (red), blue",))
        key = cached.own_key(0)
        ids = ids_of(adapter, key)
        spans = cached.load(key)["segment_spans"].tolist()
        decoded = [adapter.tokenizer.decode(ids[a:b]).replace(" ", "") for a, b in spans]
        assert decoded == [segment.replace(" ", "") for segment in split_segments(key)]
        separators = [adapter.tokenizer.decode(ids[a[1]:b[0]]).strip() for a, b in pairwise(spans)]
        assert separators == [","] * (len(spans) - 1)


def test_spans_are_found_in_the_text_the_family_encodes(tiny_cache):
    """Wan cleans prompts first (html entities, spacing): the spans are those of the cleaned caption's tokens."""
    wan = get_adapter_class("wan").load(model_config(arch="wan", name_or_path="tiny"), CPU, torch.float32)
    caption = "fish &amp; chips,   sea"
    ids = wan.tokenizer(wan.text.encoder_text(caption)).input_ids
    spans = segment_spans(wan.text, caption, len(ids)).tolist()
    assert [wan.tokenizer.decode(ids[a:b]).strip() for a, b in spans] == ["fish & chips", "sea"]
    # a comma the cleaning makes inside a segment belongs to that segment: the segment count stays the caption's
    caption = "fish &#44; chips, sea"
    ids = wan.tokenizer(wan.text.encoder_text(caption)).input_ids
    spans = segment_spans(wan.text, caption, len(ids)).tolist()
    assert [wan.tokenizer.decode(ids[a:b]).replace(" ", "") for a, b in spans] == ["fish,chips", "sea"]


def test_tokenizers_without_offsets_find_the_same_clip_spans(sd15):
    for caption in CAPTIONS + ("a  photo ,of,  (sks) dog", "a, (red), blue"):
        ranges = segment_ranges(caption)
        assert prefix_token_spans(sd15.tokenizer, caption, ranges) == offset_token_spans(sd15.tokenizer, caption,
                                                                                           ranges)


def test_entries_written_without_spans_get_them_from_the_caption(tmp_path, sd15):
    _, cached = caption_sources(tmp_path, sd15, captions=CAPTIONS[:1], shuffle_tokens=True)
    key = cached.own_key(0)
    path = cached.path(key)
    written = load_file(str(path))
    save_file({name: t for name, t in written.items() if name != "segment_spans"}, str(path))
    _, again = caption_sources(tmp_path, sd15, captions=CAPTIONS[:1], shuffle_tokens=True)
    assert "segment_spans" not in load_file(str(path))  # nothing re-encoded
    assert "segment_spans" not in again.load(key)  # read as written: found only when a view needs them
    for epoch in range(6):
        assert torch.equal(again.view(0, epoch)["embeds"], cached.view(0, epoch)["embeds"])
    assert torch.equal(again.load(key)["segment_spans"], written["segment_spans"])


def test_view_positions_keep_fixed_rows_and_shorten_variable_ones():
    spans = torch.tensor([[1, 3], [4, 6], [7, 9]])  # start token, a a , b b , c c, end token at 9, padding
    same = view_positions(spans, (0, 1, 2), (1, 9), 10, 12, keep_length=True)
    assert same[0].tolist() == list(range(12)) and same[1] == 10
    dropped = view_positions(spans, (0, 2), (1, 9), 10, 12, keep_length=True)
    assert dropped[0].tolist() == [0, 1, 2, 3, 7, 8, 9, 10, 11, 11, 11, 11] and dropped[1] == 7
    spans = torch.tensor([[0, 2], [3, 5], [6, 8]])  # a a , b b , c c, then the template's tail
    moved = view_positions(spans, (2, 0), (0, 8), 9, 9, keep_length=False)
    assert moved[0].tolist() == [6, 7, 2, 0, 1, 8] and moved[1] == 6


def test_a_segment_whose_last_token_holds_the_comma_brings_it_along():
    """CLIP's and byte-level BPE's vocabularies have `),` as one token (`hatsune miku (vocaloid), ...`)."""
    spans = torch.tensor([[1, 2], [3, 6], [6, 7], [8, 9]])  # start, x , ( red ), y , z, end, padding
    inward = view_positions(spans, (2, 1, 0, 3), (1, 9), 10, 12, keep_length=True)  # y, (red), x, z
    assert inward[0].tolist() == [0, 6, 2, 3, 4, 5, 1, 7, 8, 9, 10, 11] and inward[1] == 10
    last = view_positions(spans, (0, 2, 3, 1), (1, 9), 10, 12, keep_length=True)  # x, y, z, (red),
    assert last[0].tolist() == [0, 1, 2, 6, 7, 8, 7, 3, 4, 5, 9, 10] and last[1] == 11
    full = view_positions(spans, (0, 2, 3, 1), (1, 9), 10, 10, keep_length=True)  # no padding: cut as the encoder cuts
    assert full[0].tolist() == [0, 1, 2, 6, 7, 8, 7, 3, 4, 9] and full[1] == 10


def test_token_dropout_is_accepted_with_cached_text_embeddings(tmp_path, registry):
    process = trainer_process(tmp_path, train={"steps": 2, "cache_text_embeddings": True})
    process["datasets"][0]["token_dropout_rate"] = 0.2
    config, _ = load_config(str(write_job(tmp_path / "job.yaml", "x", process)), registry)
    assert config.config.process[0].datasets[0].token_dropout_rate == 0.2


# ---- captions whose cleaning for the encoder makes commas -------------------------------------------------------


class CommaCleaning(TextRules):
    """Wan-style cleaning on sd15's CLIP: html entities unescaped ("&#44;" is a comma), a full-width comma made a
    comma (as ftfy does), spaces collapsed. The cleaning is the same segment by segment."""

    def encoder_text(self, caption: str) -> str:
        return " ".join(html.unescape(caption).replace("\uff0c", ",").split())


class AcrossCommas(CommaCleaning):
    """A cleaning that reads across commas: an empty segment (", ,") disappears."""

    def encoder_text(self, caption: str) -> str:
        return super().encoder_text(caption).replace(", ,", ",")


def cleaning(adapter, rules: type[TextRules], monkeypatch) -> TextRules:
    """The adapter with `rules` as its text rules, its `encode_prompts` cleaning every prompt with them first (as Wan's
    does)."""
    text = rules(adapter)
    encode = adapter.encode_prompts
    monkeypatch.setattr(adapter, "text", text)
    monkeypatch.setattr(adapter, "encode_prompts", lambda prompts: encode([text.encoder_text(p) for p in prompts]))
    return text


#: a full-width comma and an html comma inside segments: cleaned, each is a comma inside its segment
CLEANED_CAPTIONS = ("red\uff0cround, shiny &#44; small, outdoors", "a photo, blue, grass")


def test_commas_made_by_cleaning_stay_inside_their_segments_cached_and_live(tmp_path, sd15, monkeypatch):
    rules = cleaning(sd15, CommaCleaning, monkeypatch)
    # no shuffle or token dropout: the cache builds and every view is the whole entry
    _, whole = caption_sources(tmp_path / "whole", sd15, captions=CLEANED_CAPTIONS, caption_dropout_rate=0.2)
    for index in range(len(CLEANED_CAPTIONS)):
        for epoch in range(4):
            view = whole.view(index, epoch)
            entry = whole.load(whole.own_key(index) if view["length"] > 2 else "")
            assert torch.equal(view["embeds"], entry["embeds"])
    # moved and dropped segments: the live token sequences
    live, cached = caption_sources(tmp_path / "views", sd15, captions=CLEANED_CAPTIONS, **VIEW_KEYS)
    key = cached.own_key(0)
    assert cached.load(key)["segment_spans"].shape == (4, 2)  # sks, red，round, shiny &#44; small, outdoors
    carrying_ids(cached, lambda caption: clip_ids(sd15, rules.encoder_text(caption)), monkeypatch)
    moved = 0
    for index in range(len(CLEANED_CAPTIONS)):
        for epoch in range(8):
            text = live.caption(index, epoch)
            view = cached.view(index, epoch)
            assert torch.equal(view["embeds"][:, 0], clip_ids(sd15, rules.encoder_text(text))), (index, epoch, text)
            moved += text not in ("", ", ".join(split_segments(cached.own_key(index))))
    assert moved > 0


def test_segments_a_cleaning_hides_are_refused_naming_the_caption_file_only_where_views_move_them(tmp_path, sd15,
                                                                                                   monkeypatch):
    cleaning(sd15, AcrossCommas, monkeypatch)
    captions = ("green, \uff0c, leaf", "plain, words")
    # caption dropout alone needs no segments: the cache builds and reads
    _, still = caption_sources(tmp_path / "still", sd15, captions=captions, caption_dropout_rate=0.3)
    key = still.own_key(0)
    assert "segment_spans" not in still.load(key)
    assert {int(still.view(0, epoch)["length"]) for epoch in range(8)} == {2, int(still.load(key)["length"])}
    # shuffled: refused before anything is encoded, naming the sample whose caption it is
    with pytest.raises(SegmentsUnknown, match="img0.png.*set train.cache_text_embeddings: false") as refused:
        caption_sources(tmp_path / "moving", sd15, captions=captions, shuffle_tokens=True)
    assert isinstance(refused.value, UserError)
    assert str(tmp_path / "moving" / "data" / "img0.png") in str(refused.value)
    assert not (tmp_path / "moving" / "cache" / "text").exists()
    # an entry read by a view that moves its segments (a cache the check did not see): the same error
    moving = CachedCaptions(sd15, still.dataset, [still.cfgs[0].model_copy(update={"shuffle_tokens": True})], seed=3,
                            trigger_word="sks", roots={0: tmp_path / "still" / "cache"})
    with pytest.raises(SegmentsUnknown, match="img0.png"):
        for epoch in range(8):
            moving.view(0, epoch)
    rows = sorted(still.load(still.own_key(1))["embeds"].tolist())
    views = [moving.view(1, epoch) for epoch in range(8)]
    assert all(sorted(v["embeds"].tolist()) == rows for v in views if int(v["length"]) > 2)  # its segments move


# ---- a trigger word with commas ----------------------------------------------------------------------------------


def test_a_trigger_word_with_commas_stays_whole_and_in_place():
    trigger = "ohwx man, photo"
    leading = split_segments(f"{trigger}, a, b, c, d, e")  # prepended: the trigger is the first two segments
    inside = split_segments(f"a, b, {trigger}, c, d, e")  # `[trigger]` in the middle
    for index in range(300):
        generator = seeded_generator(2, "caption", 0, index)
        order = plan_caption_view(leading, generator, shuffle=True, keep_tokens=0, token_dropout_rate=0.4,
                                  trigger_word=trigger).order
        assert order[:2] == (0, 1)
        order = plan_caption_view(inside, seeded_generator(2, "caption", 1, index), shuffle=True, keep_tokens=1,
                                  token_dropout_rate=0.4, trigger_word=trigger).order
        kept = sorted(order)
        assert {2, 3} <= set(kept)
        assert order[kept.index(2)] == 2 and order[kept.index(3)] == 3  # both keep their slots: adjacent, in order
        text = process_caption(", ".join(inside), seeded_generator(2, "caption", 1, index), shuffle=True,
                               token_dropout_rate=0.4, trigger_word=trigger)
        assert trigger in text
    # a one-segment trigger word still marks the segment holding it, as before
    assert plan_caption_view(["a", "b", "sks dog", "c"], seeded_generator(0, "caption", 0, 0), token_dropout_rate=1.0,
                             trigger_word="sks").order == (0, 2)
