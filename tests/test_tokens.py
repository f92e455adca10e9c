"""Token ids kept per prompt (`toolkit.models.tokens`): exactly the tokenizer's own batch call, for each family's
kind of tokenizer and padding, whatever was read before."""

from __future__ import annotations

import pytest
import torch

from toolkit.models.tokens import TokenMemo, TokenMemos

PROMPTS = [
    "a photo of shp, red hat",
    "",
    "shp",
    "a photo of shp, red hat",  # read again: from the memo
    "very long " * 60 + "end",  # longer than every max_length below: truncated
    "ünïcode, emoji 🎨, tabs\tand  spaces",
    "shp",
]


def clip_tokenizer():
    from toolkit.models.tiny import byte_level_clip_tokenizer

    return byte_level_clip_tokenizer(77)


def t5_tokenizer():
    from toolkit.models.tiny import unigram_t5_tokenizer

    return unigram_t5_tokenizer()


def qwen_tokenizer():
    from toolkit.models.zimage.tiny import byte_level_qwen_tokenizer

    return byte_level_qwen_tokenizer()


def template_tokenizer():
    from toolkit.models.qwen_image.tiny import template_bpe_tokenizer

    return template_bpe_tokenizer()


#: (tokenizer, max_length, pad_to_max, options): the calls of the families' encode_prompts
CALLS = {
    "clip (SD 1.5, SDXL, Wuerstchen, FLUX.1's first)": (clip_tokenizer, 77, True, {}),
    "t5 (FLUX.1's second)": (t5_tokenizer, 64, True, {}),
    "t5 to the longest (Wan)": (t5_tokenizer, 64, False, {"add_special_tokens": True}),
    "qwen to max length (Z-Image)": (qwen_tokenizer, 48, True, {}),
    "template bpe to the longest (Qwen-Image)": (template_tokenizer, 96, False, {}),
}


def batches(prompts: list[str]) -> list[list[str]]:
    """Batches of 1, 2 and 3 prompts over the list, so rows are padded beside shorter and longer ones."""
    return [prompts[i:i + size] for size in (1, 2, 3) for i in range(0, len(prompts), size)]


@pytest.mark.parametrize("name", list(CALLS))
def test_memo_gives_the_tokenizers_own_ids_and_mask(name):
    make, max_length, pad_to_max, options = CALLS[name]
    tokenizer = make()
    memo = TokenMemo(tokenizer, max_length, pad_to_max, **options)
    for batch in batches(PROMPTS) + batches(PROMPTS[::-1]):
        expected = tokenizer(batch, max_length=max_length, truncation=True,
                             padding="max_length" if pad_to_max else True, return_tensors="pt", **options)
        got = memo(batch)
        assert torch.equal(got.input_ids, expected.input_ids), batch
        assert torch.equal(got.attention_mask, expected.attention_mask), batch
        assert got.input_ids.dtype == expected.input_ids.dtype == torch.long


def test_left_padding_follows_the_tokenizer():
    tokenizer = qwen_tokenizer()
    tokenizer.padding_side = "left"
    memo = TokenMemo(tokenizer, 48, pad_to_max=False)
    batch = ["shp", "a photo of shp, red hat"]
    expected = tokenizer(batch, max_length=48, truncation=True, padding=True, return_tensors="pt")
    assert expected.attention_mask[0, 0] == 0  # padded on the left indeed
    assert torch.equal(memo(batch).input_ids, expected.input_ids)
    assert torch.equal(memo(batch).attention_mask, expected.attention_mask)


def test_each_prompt_is_tokenized_once_and_the_least_recent_go_first():
    tokenizer = clip_tokenizer()
    calls = []
    real = type(tokenizer).__call__

    class Counting(type(tokenizer)):
        def __call__(self, text, *args, **kwargs):
            calls.append(list(text))
            return real(self, text, *args, **kwargs)

    tokenizer.__class__ = Counting
    memo = TokenMemo(tokenizer, 77, True, kept=2 * 3 * 8)  # two prompts of 3 ids (start, a byte, end), 8 bytes each
    first = memo(["a", "b", "a"])
    assert calls == [["a", "b"]]  # the prompts not kept, in one call
    assert torch.equal(first.input_ids[0], first.input_ids[2])
    memo(["a"])  # "a" becomes the most recent: "b" goes when "c" comes
    memo(["c"])
    assert list(memo.ids) == ["a", "c"] and memo.used == 48
    memo(["b", "a"])
    assert calls == [["a", "b"], ["c"], ["b"]]
    tiny = TokenMemo(tokenizer, 77, True, kept=1)  # nothing fits: the batch is still answered whole
    assert torch.equal(tiny(["a", "b", "a"]).input_ids, first.input_ids) and len(tiny.ids) == 1


def test_memos_are_per_tokenizer_and_settings():
    clip, t5 = clip_tokenizer(), t5_tokenizer()
    memos = TokenMemos()
    a = memos.tokenize(clip, ["shp"], 77, True)
    b = memos.tokenize(t5, ["shp"], 77, True)
    c = memos.tokenize(t5, ["shp"], 64, False)
    assert len(memos.memos) == 3
    assert not torch.equal(a.input_ids, b.input_ids)
    assert c.input_ids.shape[1] < 64 and b.input_ids.shape[1] == 77


def test_a_tokenizer_without_a_pad_token_is_refused():
    tokenizer = clip_tokenizer()
    tokenizer.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        TokenMemo(tokenizer, 77, True)
