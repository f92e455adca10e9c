"""The batch order of a whole run on one process: each epoch's batches of the bucket order, sharded across the
processes as accelerate shards them, one epoch after the other in one pass, from a (resumed) position.

One pass over every epoch keeps a DataLoader's workers busy across an epoch's end: they load the next epoch's
first batches while this epoch's last ones train. A loader iterated once per epoch starts loading only when the
epoch begins, so a step waits for each epoch's first batch (docs/performance.md). The sharding itself is
accelerate's `BatchSamplerShard` (every process gets every N-th batch of an epoch, the first ones repeated to even
out the shards), applied per epoch, so the batches are those that `accelerator.prepare` gave an epoch's loader."""

from __future__ import annotations

from collections.abc import Iterator

from accelerate.data_loader import BatchSamplerShard

from toolkit.data.buckets import BucketBatchSampler, EpochIndex


class EpochOrder:
    """One epoch of the bucket order, read as accelerate's shard reads a batch sampler (`batch_size = None`: batches
    of varying length, repeated whole to even out the shards)."""

    batch_size = None
    drop_last = False

    def __init__(self, order: BucketBatchSampler, epoch: int):
        self.order = order
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[EpochIndex]]:
        return iter(self.order.tagged_batches(self.epoch))

    def __len__(self) -> int:
        return len(self.order)


class RunBatchOrder:
    """A DataLoader's batch sampler: this process's micro-batches of epoch `start_epoch` and those after it, up to
    `end_epoch - 1` (None: as many as are asked for), the first `skip` of the first epoch left out (not loaded).
    `start_at` sets the range before each pass. A run's pass has no end: the trainer stops taking batches at its
    last update, which may lie beyond the plan's epochs (a resume with more updates per epoch, or on fewer
    processes, continues from its saved epoch; an fp16 update the GradScaler skips uses its micro-batches)."""

    def __init__(self, order: BucketBatchSampler, processes: int = 1, rank: int = 0):
        if not 0 <= rank < processes:
            raise ValueError(f"process {rank} of {processes}")
        self.order = order
        self.processes = processes
        self.rank = rank
        self.start_epoch, self.skip = 0, 0
        self.end_epoch: int | None = None

    def epoch(self, epoch: int) -> list[list[EpochIndex]]:
        """This process's micro-batches of an epoch, in order."""
        batches = EpochOrder(self.order, epoch)
        if self.processes == 1:  # as accelerate: one process is not sharded
            return list(batches)
        return list(BatchSamplerShard(batches, self.processes, self.rank, split_batches=False, even_batches=True))

    @property
    def per_epoch(self) -> int:
        """Micro-batches per epoch on this process: ceil(batches / processes)."""
        return -(-len(self.order) // self.processes)

    def start_at(self, epoch: int, skip: int, end_epoch: int | None = None) -> None:
        if skip < 0 or epoch < 0:
            raise ValueError(f"no micro-batch {skip} of epoch {epoch}")
        self.start_epoch, self.skip, self.end_epoch = epoch, skip, end_epoch

    def __iter__(self) -> Iterator[list[EpochIndex]]:
        return self.pass_over(self.start_epoch, self.skip, self.end_epoch)

    def pass_over(self, start_epoch: int, skip: int, end_epoch: int | None) -> Iterator[list[EpochIndex]]:
        epoch = start_epoch
        while end_epoch is None or epoch < end_epoch:
            yield from self.epoch(epoch)[skip if epoch == start_epoch else 0:]
            epoch += 1

    def __len__(self) -> int:
        if self.end_epoch is None:
            raise TypeError("a pass without an end epoch has no length")
        return max(0, (self.end_epoch - self.start_epoch) * self.per_epoch - self.skip)
