"""Aspect-ratio buckets and the batch sampler that never mixes them."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from toolkit.train.seeding import seeded_generator

MAX_ASPECT = 4.0


def bucket_sizes(resolution: int, divisor: int, max_aspect: float = MAX_ASPECT) -> list[tuple[int, int]]:
    """(width, height) pairs with sides a multiple of `divisor` and an area of at most resolution**2,
    as large as fits for each width, with aspect ratios up to `max_aspect`."""
    area = resolution * resolution
    sizes = set()
    width = divisor
    while width * divisor <= area:
        height = (area // width) // divisor * divisor
        if height >= divisor and max(width / height, height / width) <= max_aspect:
            sizes.add((width, height))
        width += divisor
    if not sizes:
        side = max(divisor, resolution // divisor * divisor)
        sizes.add((side, side))
    return sorted(sizes)


def nearest_bucket(width: int, height: int, sizes: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest (in log space) to the image's; larger wins a tie."""
    aspect = math.log(width / height)
    return min(sizes, key=lambda s: (round(abs(math.log(s[0] / s[1]) - aspect), 9), -s[0] * s[1]))


def resolutions_for_image(width: int, height: int, resolutions: list[int]) -> list[int]:
    """The training sizes an image is used at: every size not larger than the image, at least the smallest."""
    fitting = [r for r in resolutions if r * r <= width * height]
    return fitting or [min(resolutions)]


class EpochIndex(int):
    """A sample index that carries the epoch it is loaded for (`.epoch`). It is an int everywhere an index is read;
    the dataset reads the epoch from it to draw that epoch's augmentation. The epoch travels inside the index because
    a DataLoader worker holds its own copy of the dataset (kept across epochs with persistent workers), which an
    epoch set on the main process's dataset would never reach."""

    epoch: int

    def __new__(cls, index: int, epoch: int) -> EpochIndex:
        tagged = super().__new__(cls, index)
        tagged.epoch = epoch
        return tagged

    def __reduce__(self):  # to DataLoader workers, epoch included
        return EpochIndex, (int(self), self.epoch)


class BucketBatchSampler:
    """Yields lists of sample indices (`EpochIndex`: each knows the epoch); each list comes from one bucket.

    The order of an epoch is a pure function of (seed, epoch): samples are shuffled inside each bucket,
    cut into batches (a bucket's last batch may be short), and the batches are shuffled together.
    A run's loader reads it through `RunBatchOrder` (toolkit/data/run_order.py), which shards each epoch's batches
    across processes as accelerate does and chains the epochs; iterated alone, it yields the epoch `set_epoch` set.
    """

    # accelerate's shard reads these of a batch sampler it is given (`RunBatchOrder` gives it an epoch of this order,
    # `EpochOrder`, which says the same): `batch_size = None` tells it batches have varying lengths, so when it
    # evens out the shards it repeats whole batches instead of refilling them with other buckets' samples.
    batch_size = None
    drop_last = False

    def __init__(self, bucket_keys: list, per_batch: int, seed: int, shuffle: bool = True):
        if not bucket_keys:
            raise ValueError("no samples to batch")
        self.per_batch = per_batch
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        groups: dict = defaultdict(list)
        for index, key in enumerate(bucket_keys):
            groups[key].append(index)
        self.groups = [groups[k] for k in sorted(groups)]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches_for_epoch(self, epoch: int) -> list[list[int]]:
        generator = seeded_generator(self.seed, "data_order", epoch)
        batches = []
        for members in self.groups:
            order = members
            if self.shuffle:
                order = [members[i] for i in torch.randperm(len(members), generator=generator).tolist()]
            batches += [order[i : i + self.per_batch] for i in range(0, len(order), self.per_batch)]
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        return batches

    def tagged_batches(self, epoch: int) -> list[list[EpochIndex]]:
        """`batches_for_epoch`, each index carrying the epoch (what a DataLoader hands its dataset)."""
        return [[EpochIndex(index, epoch) for index in batch] for batch in self.batches_for_epoch(epoch)]

    def __iter__(self):
        return iter(self.tagged_batches(self.epoch))

    def __len__(self) -> int:
        return sum(math.ceil(len(members) / self.per_batch) for members in self.groups)
