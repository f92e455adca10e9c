"""What the training loop does on the host at every update is kept small without changing what it decides or draws:
control/ read only where it may have changed, caption views that draw nothing made once, an update's values
averaged without an operation per part, and the default number of loader workers chosen from the cores."""

from __future__ import annotations

import os
import pickle
import time
from types import SimpleNamespace

import pytest
import torch

from jobs.process.base_sd_train_process import window_means
from toolkit.data.captions import process_caption
from toolkit.data.text_cache import LiveCaptions, draws_views
from toolkit.data.training_data import TrainingData, default_num_workers
from toolkit.run import control
from toolkit.run.control import RunMonitor


def test_a_request_is_seen_at_the_next_look_however_soon_it_follows(tmp_path, monkeypatch):
    """The folder changed within the last second is read at every look: a request made in the same tick of the file
    system's clock as the last change (which leaves the folder's time as it was) is not missed."""
    monkeypatch.setattr(control, "POLL_S", 0.0)  # a look at every update
    control.Status(state="running").write(tmp_path)
    run = RunMonitor(tmp_path, enabled=True, total=0)
    assert not any(run.take_requests().values())  # no control/ yet
    for action in ("save", "stop", "sample"):
        control.request(tmp_path, action)
        assert run.take_requests()[action]
        run.acknowledge()
        assert not any(run.take_requests().values())


def test_control_is_looked_at_once_per_poll_interval_and_a_request_waits_at_most_that_long(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "POLL_S", 0.3)
    control.Status(state="running").write(tmp_path)
    run = RunMonitor(tmp_path, enabled=True, total=0)
    (tmp_path / control.CONTROL_DIR).mkdir()
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: stats.append(str(path)) or real_stat(path, *a, **k))
    began = time.monotonic()
    assert not any(run.take_requests().values())  # the first look
    control.request(tmp_path, "save")
    looked = stats.count(run.control_dir)
    while not run.take_requests()["save"]:
        assert time.monotonic() - began < 0.3 + 1.0, "the request was not seen at the look after the poll interval"
    waited = time.monotonic() - began
    assert waited >= 0.3 and stats.count(run.control_dir) == looked + 1  # one stat for the second look, none between


def test_a_settled_empty_control_folder_is_only_stated(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "POLL_S", 0.0)
    run = RunMonitor(tmp_path, enabled=True, total=0)
    (tmp_path / control.CONTROL_DIR).mkdir()
    old = time.time_ns() - 5 * 10**9
    os.utime(tmp_path / control.CONTROL_DIR, ns=(old, old))
    reads = []
    real_pending = control.pending
    monkeypatch.setattr(control, "pending", lambda run_dir: reads.append(run_dir) or real_pending(run_dir))
    for _ in range(5):
        assert not any(run.take_requests().values())
    assert len(reads) == 1  # read once, then known empty until it changes
    (tmp_path / control.CONTROL_DIR / f"{time.time_ns()}-1-stop.json").write_text("{}")
    os.utime(tmp_path / control.CONTROL_DIR, ns=(old + 1, old + 1))  # any change of its time is seen
    assert run.take_requests()["stop"] and len(reads) == 2
    run.acknowledge()
    os.utime(tmp_path / control.CONTROL_DIR, ns=(old + 2, old + 2))
    run.take_requests()
    monkeypatch.setattr(control, "RELIST_S", 0.0)  # and it is read again after a while whatever its time says
    run.take_requests()
    assert len(reads) == 4


def test_captions_that_draw_no_view_are_made_once_and_as_before():
    items = [SimpleNamespace(record=SimpleNamespace(caption="a  cat,dog ,  shp"), dataset=0),
             SimpleNamespace(record=SimpleNamespace(caption="shp, b, c, d"), dataset=1)]
    plain = SimpleNamespace(shuffle_tokens=False, keep_tokens=1, caption_dropout_rate=0.0, token_dropout_rate=0.0)
    shuffled = SimpleNamespace(shuffle_tokens=True, keep_tokens=1, caption_dropout_rate=0.0, token_dropout_rate=0.0)
    assert not draws_views(plain) and draws_views(shuffled)
    captions = LiveCaptions(None, SimpleNamespace(items=items), [plain, shuffled], seed=3, trigger_word="shp")
    generator = torch.Generator().manual_seed(0)
    expected = process_caption(items[0].record.caption, generator, shuffle=False, keep_tokens=1, trigger_word="shp")
    assert captions.caption(0, 0) == captions.caption(0, 7) == expected == "a  cat, dog, shp"
    assert list(captions.fixed_views) == [0]
    assert {captions.caption(1, epoch) for epoch in range(12)} != {"shp, b, c, d"}  # shuffled: drawn each epoch


def test_an_update_averages_its_parts_as_before():
    one = [{"loss": torch.tensor(0.25), "loss_main": torch.tensor(0.125, dtype=torch.bfloat16)}]
    assert torch.equal(window_means(one), torch.tensor([0.25, 0.125]))
    window = [{"loss": torch.tensor(v), "loss_bpp": torch.tensor(2 * v)} for v in (0.1, 0.2, 0.4)]
    expected = torch.stack([torch.stack([p[n] for p in window]).float().mean() for n in ("loss", "loss_bpp")])
    assert torch.equal(window_means(window), expected)


@pytest.mark.parametrize(("cores", "processes", "workers"), [
    (1, 1, 0), (2, 1, 0), (3, 1, 0), (4, 1, 2), (6, 1, 3), (8, 1, 4), (64, 1, 4), (16, 4, 2), (16, 8, 0), (0, 1, 0),
])
def test_the_default_number_of_loader_workers_follows_the_cores(cores, processes, workers):
    assert default_num_workers(cores, processes) == workers


def test_unset_num_workers_is_chosen_and_a_set_one_is_kept(monkeypatch):
    import toolkit.data.training_data as training_data

    monkeypatch.setattr(training_data, "usable_cores", lambda: 8)
    data = TrainingData.__new__(TrainingData)
    data.dataset = SimpleNamespace(latents=None)
    data.train = SimpleNamespace(runtime=SimpleNamespace(num_workers=None))
    assert data.num_workers() == 4 and data.num_workers(processes=2) == 2
    in_memory = SimpleNamespace(covers_everything=True, grows=False, to_disk={0: False})
    data.dataset = SimpleNamespace(latents=in_memory)
    assert data.num_workers() == 0  # nothing to read: workers would only hand batches over
    data.dataset = SimpleNamespace(latents=SimpleNamespace(covers_everything=True, grows=False, to_disk={0: True}))
    assert data.num_workers() == 4
    data.train = SimpleNamespace(runtime=SimpleNamespace(num_workers=3))
    assert data.num_workers() == 3


def test_a_modules_first_weight_is_the_one_parameters_gives_first():
    from peft import LoraConfig, inject_adapter_in_model

    from toolkit.models.common import first_weight

    class Holder(torch.nn.Module):  # no parameters of its own, an empty slot, then children
        def __init__(self):
            super().__init__()
            self.empty = None
            self.blocks = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(3, 4), torch.nn.Conv2d(4, 4, 1))
            self.scale = torch.nn.Parameter(torch.ones(1))

    holder = Holder()
    adapted = inject_adapter_in_model(LoraConfig(r=2, target_modules=["1"]), Holder())
    for module in (holder, holder.blocks, torch.nn.Linear(2, 2), adapted):
        assert first_weight(module) is next(module.parameters())
    with pytest.raises(ValueError, match="Identity has no parameters"):
        first_weight(torch.nn.Identity())


def test_a_batch_is_placed_tensor_by_tensor_its_pending_rows_too_and_its_lists_stay():
    from toolkit.data.training_data import on_device

    batch = {"captions": ["a"], "indices": [3], "variants": [None], "latent_mean": torch.ones(1, 4, 2, 2),
             "mask": torch.ones(1, 1, 2, 2),
             "pending": {"rows": [0], "keys": ["k"], "pixels": torch.zeros(1, 3, 8, 8)}}
    placed = on_device(batch, torch.device("meta"))
    assert placed["latent_mean"].device.type == placed["mask"].device.type == "meta"
    assert placed["pending"]["pixels"].device.type == "meta"
    assert (placed["captions"], placed["indices"], placed["pending"]["rows"], placed["pending"]["keys"]) == (
        ["a"], [3], [0], ["k"])
    assert batch["latent_mean"].device.type == "cpu"  # the loader's batch is left as it was
    assert on_device(batch, torch.device("cpu"))["latent_mean"] is batch["latent_mean"]  # already there: not copied


def test_the_objectives_kept_generators_draw_what_fresh_ones_draw():
    from toolkit.train.objective import DiffusionObjective
    from toolkit.train.seeding import seeded_generator

    objective = DiffusionObjective.__new__(DiffusionObjective)  # only its seed and generators are used here
    objective.seed, objective.generators = 7, {}
    for counters in [(0, 0, 0), (0, 1, 0), (3, 2, 1), (0, 0, 0)]:
        for purpose in ("noise", "timestep"):
            kept = torch.randn(5, generator=objective.seeded(purpose, *counters))
            assert torch.equal(kept, torch.randn(5, generator=seeded_generator(7, purpose, *counters)))
    assert len(objective.generators) == 2


def test_a_tensor_already_of_the_dtype_and_device_is_returned_as_it_is():
    from toolkit.device import as_dtype, to_device

    tensor = torch.ones(2, 3)
    assert as_dtype(tensor, torch.float32) is tensor and to_device(tensor, torch.device("cpu")) is tensor
    assert to_device(tensor, "cpu", torch.float32) is tensor
    converted = as_dtype(tensor, torch.bfloat16)
    assert converted.dtype == torch.bfloat16 and tensor.dtype == torch.float32
    assert to_device(tensor, "cpu", torch.float64).dtype == torch.float64
    assert to_device(tensor, "meta").device.type == "meta"


@pytest.mark.parametrize("tensor", [torch.randn(3, 8, 8), torch.randn(2, 5).to(torch.bfloat16), torch.tensor([True, False]),
                                    torch.arange(6).reshape(2, 3), torch.empty(0, 4), torch.tensor(2.5)],
                         ids=["float32", "bfloat16", "bool", "int64", "empty", "0-dim"])
def test_a_small_tensor_from_a_loader_worker_travels_as_its_bytes_and_arrives_whole(tensor):
    """Pickled as the worker's queue pickles it: bytes in the message (no shared-memory handle), back as a tensor of
    its own with the same dtype, shape and values, writable."""
    from multiprocessing.reduction import ForkingPickler

    from toolkit.data.handover import ByValue

    message = ForkingPickler.dumps(ByValue(tensor))
    assert len(message) >= tensor.numel() * tensor.element_size()  # the values are in the message
    received = pickle.loads(message)
    assert received.dtype == tensor.dtype and received.shape == tensor.shape and torch.equal(received, tensor)
    assert received.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr() or tensor.numel() == 0
    received.add_(1) if received.dtype != torch.bool else received.logical_not_()  # writable, as shared memory gives


def test_a_workers_batch_sends_its_small_tensors_by_value_and_large_ones_through_shared_memory():
    from toolkit.data.handover import BY_VALUE_BYTES, ByValue, by_value, collate_in_worker

    large = torch.zeros(BY_VALUE_BYTES // 4 + 1)
    batch = by_value({"pixels": torch.zeros(3, 8, 8), "large": large, "indices": [1, 2], "captions": ["a", "b"],
                      "pending": {"pixels": torch.ones(1, 3, 8, 8), "rows": [0]}})
    assert isinstance(batch["pixels"], ByValue) and isinstance(batch["pending"]["pixels"], ByValue)
    assert batch["large"] is large and batch["indices"] == [1, 2] and batch["pending"]["rows"] == [0]
    # a large view (a batch of one: the latent cache's own entry) is copied, so the entry never moves to shared memory
    entry = torch.zeros(BY_VALUE_BYTES // 4 + 1)
    sent = by_value({"latent_mean": entry.unsqueeze(0)})["latent_mean"]
    assert torch.equal(sent[0], entry) and sent.untyped_storage().data_ptr() != entry.untyped_storage().data_ptr()
    samples = [{"caption": "a", "index": 0, "variant": None, "pixels": torch.zeros(3, 8, 8)}]
    assert isinstance(collate_in_worker(samples)["pixels"], ByValue)
