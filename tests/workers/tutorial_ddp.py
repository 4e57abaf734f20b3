"""PyTorch's DDP tutorial script (multigpu_torchrun.py) ported to resilient.

The diff against tests/workers/tutorial_original.py is the port: lines marked # resilient
(the snapshot code is deleted). resilient.init() makes the process group instead of
ddp_setup(); checkpoints go to the snapshot path, a directory now.
"""

import logging
import os

import structlog
import torch
import torch.nn.functional as F
from torch.distributed import init_process_group  # resilient: rt.close() destroys the group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader as DataLoader  # noqa: F811 resilient

import resilient  # resilient


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.rt = resilient.current()  # resilient
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every

        self.model = DDP(self.model)
        self.rt.track(model=self.model, optimizer=optimizer, loader=train_data)  # resilient

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = self.train_data.batch_size  # resilient: no batch drawn outside a step
        print(
            f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}"
        )
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.rt.batches():  # resilient
            self._run_batch(source, targets)

    def train(self, max_epochs: int):
        for epoch in self.rt.epochs(max_epochs, save_every_epochs=self.save_every):  # resilient
            self._run_epoch(epoch)


def load_train_objs():
    torch.manual_seed(0)
    train_set = MyTrainDataset(96)  # load your dataset
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=False,
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str = "snapshot.pt"):
    resilient.init(snapshot_path)  # resilient: the process group, restarts included
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    trainer.rt.close()  # resilient


if __name__ == "__main__":
    import argparse

    logging.basicConfig(level=logging.WARNING)  # the user's own logging set-up
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=8, type=int, help="Input batch size on each device")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path)
