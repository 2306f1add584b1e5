"""ReplayableData: replay a step's batches, read ahead, own epochs, and fast-forward a spare."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from torchpass.core.data import ReplayableData


def loader(n: int = 10, batch_size: int = 2, seed: int = 3) -> DataLoader:
    """Rank 0 of 2 over ``n`` samples, shuffled per epoch: 3 batches of 2, 2, 1 for n=10."""
    dataset = TensorDataset(torch.arange(n))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def values(batch) -> list[int]:
    return batch[0].tolist() if isinstance(batch, list) else batch


def take(data: ReplayableData, n: int) -> list:
    return [values(data.next_batch()) for _ in range(n)]


def reference(n_batches: int, **kw) -> list:
    """The batches a plain, never-rewound iteration over epochs yields."""
    ref = loader(**kw)
    out: list = []
    epoch = 0
    while len(out) < n_batches:
        ref.sampler.set_epoch(epoch)
        out += [values(b) for b in ref]
        epoch += 1
    return out[:n_batches]


# ---- a plain list --------------------------------------------------------------------


def test_next_batch_over_a_list_counts_position():
    data = ReplayableData(["a", "b", "c"])
    assert take(data, 2) == ["a", "b"]
    assert data.position == 2 and data.read == 2 and data.in_epoch == 2 and data.epoch == 0


def test_list_rolls_over_into_the_next_epoch():
    data = ReplayableData([1, 2, 3])
    assert take(data, 7) == [1, 2, 3, 1, 2, 3, 1]
    assert data.epoch == 2 and data.in_epoch == 1


def test_seek_back_to_a_kept_step_replays_identical_batches():
    data = ReplayableData(list(range(100)))
    data.mark_step(1)
    first = take(data, 3)
    assert data.step_start(1) == 0
    data.seek(data.step_start(1))
    assert data.position == 0
    assert take(data, 3) == first
    assert take(data, 1) == [3]  # replay exhausted: reading continues from the source
    assert data.read == 4 and data.position == 4


def test_seek_back_into_the_middle_of_a_step():
    data = ReplayableData(list(range(100)))
    data.mark_step(1)
    take(data, 4)
    data.seek(2)
    assert take(data, 3) == [2, 3, 4]


def test_only_kept_steps_can_be_replayed():
    data = ReplayableData(list(range(100)), keep_steps=2)
    for step in (1, 2, 3):
        data.mark_step(step)
        take(data, 2)
    assert data.step_start(1) is None  # dropped: only two steps are kept
    assert data.step_start(2) == 2 and data.step_start(3) == 4
    data.seek(2)
    assert take(data, 4) == [2, 3, 4, 5]
    with pytest.raises(RuntimeError, match="cannot rewind the data to batch 1: only batches from 2 on are kept"):
        data.seek(1)


def test_rewind_beyond_kept_steps_raises_with_keep_one():
    data = ReplayableData(list(range(10)))
    data.mark_step(1)
    take(data, 2)
    data.mark_step(2)
    take(data, 2)
    with pytest.raises(RuntimeError, match="cannot rewind"):
        data.seek(0)
    data.seek(2)
    assert take(data, 2) == [2, 3]


def test_seek_forward_reads_ahead():
    data = ReplayableData(list(range(10)))
    data.mark_step(1)
    take(data, 1)
    data.seek(4)
    assert data.position == 4 and data.read == 4
    assert take(data, 2) == [4, 5]
    data.seek(0)  # the batches read ahead are kept like any others
    assert take(data, 6) == [0, 1, 2, 3, 4, 5]


def test_seek_forward_across_an_epoch_boundary():
    data = ReplayableData([0, 1, 2])
    data.mark_step(1)
    data.seek(5)
    assert data.epoch == 1
    assert take(data, 2) == [2, 0]


def test_snapshot_during_a_replay_names_the_next_batch():
    data = ReplayableData([0, 1, 2])
    data.mark_step(1)
    take(data, 4)  # epoch 0: 0 1 2, epoch 1: 0
    data.seek(2)
    assert data.snapshot() == {"position": 2, "epoch": 0, "in_epoch": 2}
    take(data, 2)
    assert data.snapshot() == {"position": 4, "epoch": 1, "in_epoch": 1}


def test_one_shot_iterators_are_rejected():
    with pytest.raises(TypeError, match="re-iterable"):
        ReplayableData(iter([1, 2, 3]))
    with pytest.raises(TypeError, match="one-shot iterator"):
        ReplayableData(x for x in range(3))


def test_empty_source_raises():
    data = ReplayableData([])
    with pytest.raises(RuntimeError, match="yields no batches"):
        data.next_batch()


def test_re_marking_a_replayed_step_keeps_the_older_steps():
    data = ReplayableData(list(range(100)), keep_steps=2)
    data.mark_step(1)
    take(data, 2)
    data.mark_step(2)
    take(data, 2)
    data.seek(data.step_start(2))  # step 2 interrupted: rewind and re-execute it
    data.mark_step(2)
    assert data.step_start(1) == 0
    data.seek(0)
    assert take(data, 4) == [0, 1, 2, 3]


# ---- a DataLoader with a DistributedSampler ------------------------------------------------


def test_dataloader_batches_match_a_plain_iteration_over_epochs():
    data = ReplayableData(loader())
    assert take(data, 8) == reference(8)
    assert data.epoch == 2


def test_epoch_rollover_calls_set_epoch():
    dl = loader()
    calls: list[int] = []
    original = dl.sampler.set_epoch

    def spy(epoch: int) -> None:
        calls.append(epoch)
        original(epoch)

    dl.sampler.set_epoch = spy
    data = ReplayableData(dl)
    take(data, 7)  # 3 batches per epoch
    assert calls == [0, 1, 2]


def test_set_epoch_on_the_source_itself():
    class Source:
        def __init__(self):
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

        def __iter__(self):
            return iter([10 * len(self.epochs), 10 * len(self.epochs) + 1])

    source = Source()
    data = ReplayableData(source)
    assert take(data, 5) == [10, 11, 20, 21, 30]
    assert source.epochs == [0, 1, 2]


def test_dataloader_replay_after_seek_back():
    data = ReplayableData(loader())
    take(data, 2)
    data.mark_step(5)
    step = take(data, 3)  # crosses into epoch 1
    data.seek(data.step_start(5))
    assert take(data, 3) == step
    assert take(data, 2) == reference(7)[5:7]


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 4, 7])
def test_snapshot_and_fast_forward_continue_with_identical_batches(consumed):
    original = ReplayableData(loader())
    take(original, consumed)
    snap = original.snapshot()
    expected = take(original, 4)

    spare = ReplayableData(loader())
    spare.fast_forward(snap)
    assert spare.position == consumed
    assert take(spare, 4) == expected
    assert spare.epoch == original.epoch and spare.in_epoch == original.in_epoch


def test_fast_forward_from_a_snapshot_taken_during_a_replay():
    original = ReplayableData(loader())
    original.mark_step(1)
    take(original, 5)
    original.seek(2)
    snap = original.snapshot()
    expected = take(original, 4)
    spare = ReplayableData(loader())
    spare.fast_forward(snap)
    assert take(spare, 4) == expected == reference(6)[2:6]


def test_fast_forward_calls_set_epoch_with_the_target_epoch():
    dl = loader()
    calls: list[int] = []
    original = dl.sampler.set_epoch
    dl.sampler.set_epoch = lambda e: (calls.append(e), original(e))
    data = ReplayableData(dl)
    data.fast_forward({"position": 7, "epoch": 2, "in_epoch": 1})
    assert calls == [2]
    assert take(data, 3) == reference(10)[7:10]
    assert calls == [2, 3]


def _lazy_loader_passes(loader: DataLoader):
    """A generator per pass, like DeepSpeed's loader: the DataLoader starts (and draws) at the first next()."""

    class Passes:
        def __iter__(self):
            return (batch for batch in loader)

    return Passes()


@pytest.mark.parametrize("lazy", [False, True])
def test_starting_an_epoch_leaves_the_global_rng_where_it_was(lazy):
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, shuffle=True)
    data = ReplayableData(_lazy_loader_passes(loader) if lazy else loader)
    torch.manual_seed(5)
    expected = torch.get_rng_state()
    data.next_batch()
    assert torch.equal(torch.get_rng_state(), expected)


def test_lazy_fast_forward_opens_the_epoch_at_the_first_batch():
    sampler = DistributedSampler(TensorDataset(torch.arange(16.0)), num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = DataLoader(TensorDataset(torch.arange(16.0)), batch_size=2, sampler=sampler)
    sampler.set_epoch(1)
    reference = [b[0].tolist() for b in loader]
    data = ReplayableData(_lazy_loader_passes(loader), lazy_fast_forward=True)
    data.fast_forward({"position": 11, "epoch": 1, "in_epoch": 3})
    assert (data.epoch, data.in_epoch, data.position) == (1, 3, 11)
    sampler.set_epoch(1)  # the training loop's own per-epoch call, made after the spare attached
    assert data.next_batch()[0].tolist() == reference[3]
