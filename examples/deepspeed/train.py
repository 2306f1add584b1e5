"""A DeepSpeed ZeRO job made migratable by the "torchpass" block of its config (CPU, gloo).

    torchpass launch --nproc-per-node 2 --spares-per-node 1 examples/deepspeed/train.py \
        --deepspeed_config examples/deepspeed/ds_config.json --epochs 2

Nothing in the script mentions torchpass: the loop is DeepSpeed's own (epochs over the training
dataloader ``deepspeed.initialize`` returns; forward, ``engine.backward``, ``engine.step``). Kill a rank
while it trains (``torchpass inject --run-dir torchpass_run --rank 1 --fault kill``, or ``kill -9``): a
spare takes its place and training continues from the interrupted step. ``--pipe`` trains a 2-stage
pipeline instead (``--nproc-per-node 4``: pipeline 2 x data 2; set ``"stage": 1`` in the config, pipelines
take ZeRO 0 or 1) with an ``engine.train_batch`` loop. With plain ``deepspeed``/``torchrun`` the same script
trains the same way, without migration.
"""

import argparse

import deepspeed
import torch
from deepspeed.pipe import PipelineModule
from deepspeed.utils import RepeatingLoader
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def layers(hidden: int) -> list[torch.nn.Module]:
    return [torch.nn.Linear(32, hidden), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(hidden, 1)]


class Regression(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*layers(hidden))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=640, help="dataset size (640: 20 steps per epoch on 2 ranks)")
    parser.add_argument("--steps", type=int, default=20, help="--pipe: train_batch calls")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--pipe", action="store_true", help="2-stage pipeline trained with engine.train_batch")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(args.samples, 32, generator=g)
    y = (x @ torch.randn(32, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(args.samples, generator=g)
    dataset = TensorDataset(x, y)

    if args.pipe:
        loss_fn = lambda out, target: torch.nn.functional.mse_loss(out.squeeze(1), target)  # noqa: E731
        net = PipelineModule(layers=layers(args.hidden), num_stages=2, loss_fn=loss_fn)
        engine, *_ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters())
        grid = engine.grid
        sampler = DistributedSampler(dataset, grid.data_parallel_size, grid.data_parallel_id, seed=7)
        batches = RepeatingLoader(DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler))
        for _ in range(args.steps):
            loss = engine.train_batch(batches)
            if engine.global_rank == 0:
                print(f"step {engine.global_steps}: loss {loss.item():.5f}", flush=True)
        return

    model = Regression(args.hidden)
    engine, _, trainloader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )
    for epoch in range(args.epochs):
        trainloader.data_sampler.set_epoch(epoch)
        for xb, yb in trainloader:
            loss = engine(xb, yb)
            engine.backward(loss)
            engine.step()
            if engine.global_rank == 0 and engine.micro_steps % engine.gradient_accumulation_steps() == 0:
                print(f"epoch {epoch} step {engine.global_steps}: loss {loss.item():.5f}", flush=True)

if __name__ == "__main__":
    main()
