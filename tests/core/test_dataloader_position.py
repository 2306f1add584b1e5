"""open_at: a DataLoader pass opened at batch n loads no sample before it, and yields what a full pass would."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from torchpass.core.dataloader_position import open_at


class Counted(Dataset):
    """Sample i is tensor([i]); every fetch is recorded in a file (worker processes cannot share a list)."""

    def __init__(self, n: int, log):
        self.n, self.log = n, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return torch.tensor([i])


def _fetched(log) -> list[int]:
    return [int(x) for x in log.read_text().split()] if log.exists() else []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_opened_at_n_loads_nothing_before_it(tmp_path, workers: int) -> None:
    log = tmp_path / "fetches"
    data = Counted(64, log)
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=7)
    sampler.set_epoch(3)
    loader = DataLoader(data, batch_size=2, sampler=sampler, num_workers=workers)
    full = [b.flatten().tolist() for b in loader]
    log.unlink()
    skip = 11  # of 16 batches
    tail = [b.flatten().tolist() for b in open_at(loader, skip)]
    assert tail == full[skip:]
    # With workers, the batches sent to them before the pass could be positioned (torch's default
    # prefetch_factor of 2 per worker) are loaded in vain; nothing else before batch `skip` is.
    in_flight = 2 * workers
    wasted = set(_fetched(log)) - {i for batch in full[skip:] for i in batch}
    assert len(wasted) <= loader.batch_size * in_flight, sorted(wasted)
    if workers == 0:
        assert wasted == set()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loader_reports_the_position_it_was_opened_at(tmp_path, workers: int) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    log = tmp_path / "fetches"
    loader = StatefulDataLoader(Counted(40, log), batch_size=2, shuffle=False, num_workers=workers)
    it = open_at(loader, 7, StatefulDataLoader.__iter__)
    assert next(it).flatten().tolist() == [14, 15]
    # Its checkpoint, restored into a fresh loader, resumes right after: the skipped batches count as handed out.
    state = loader.state_dict()
    fresh = StatefulDataLoader(Counted(40, log), batch_size=2, shuffle=False, num_workers=workers)
    fresh.load_state_dict(state)
    assert next(iter(fresh)).flatten().tolist() == [16, 17]
    if workers == 0:
        assert min(_fetched(log)) == 14


def test_the_end_of_an_epoch_is_an_empty_pass(tmp_path) -> None:
    loader = DataLoader(Counted(8, tmp_path / "log"), batch_size=2)
    assert list(open_at(loader, 4)) == []


def test_an_iterable_dataset_is_drawn_and_dropped(tmp_path) -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    loader = DataLoader(Stream(), batch_size=3)
    assert [b.tolist() for b in open_at(loader, 2)] == [[6, 7, 8], [9]]
