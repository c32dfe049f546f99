"""A CNN classifier in the shape of pytorch/examples' ``mnist/main.py``, as a ddp-service task.

The model below is that program's ``Net`` (two convolutions, max-pool, dropout,
two linear layers, ``log_softmax``), trained with its loss (``F.nll_loss``),
its optimizer (Adadelta) and its scheduler (StepLR). Only the sizes are small
(an option), and the images are synthetic (no download): ten noisy stroke
patterns, normalized with MNIST's mean and std as the original does.

Run it with this folder on PYTHONPATH:

    PYTHONPATH=examples torchrun --standalone --nproc_per_node=2 -m service train examples/mnist.yaml

What the original's ``main()`` did and the service now does: the device, the
DataLoaders (sharded over ranks, resumable), ``train()``'s loop (zero_grad,
backward, step, logging), ``test()``'s summed loss and accuracy (over the whole
eval set across ranks), ``scheduler.step()`` and ``--save-model``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Dataset

from service.tasks.base import Task, TaskSpec

# --- the user's code, in its source's shape ---------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, width: int = 32, hidden: int = 128, image_size: int = 28) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, 1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        flat = 2 * width * ((image_size - 4) // 2) ** 2  # 9216 at the original's 28x28 and width 32
        self.fc1 = nn.Linear(flat, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


class SyntheticDigits(Dataset):
    """MNIST-like ``(image, label)`` pairs: each class a fixed random stroke pattern, plus noise and a shift.

    Map-style (``__len__``, ``__getitem__``) and deterministic, like ``datasets.MNIST``
    with ``transforms.Normalize((0.1307,), (0.3081,))``.
    """

    def __init__(self, count: int, image_size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        templates = torch.rand(10, 1, image_size, image_size, generator=torch.Generator().manual_seed(1234)) > 0.8
        self.labels = torch.randint(0, 10, (count,), generator=gen)
        images = templates[self.labels].float()
        shifts = torch.randint(-1, 2, (count, 2), generator=gen)
        images = torch.stack([img.roll(tuple(s.tolist()), dims=(1, 2)) for img, s in zip(images, shifts, strict=True)])
        images = (images + 0.3 * torch.randn(images.shape, generator=gen)).clamp(0, 1)
        self.images = (images - 0.1307) / 0.3081

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.images[index], self.labels[index]


# --- the task: the glue ---------------------------------------------------------------------------------------


def correct(output: Tensor, target: Tensor) -> Tensor:
    return (output.argmax(dim=1) == target).float()  # test()'s pred.eq(target), one score per sample


def build(spec: TaskSpec) -> Task:
    size, lr = int(spec.option("image_size", 12)), float(spec.option("lr", 1.0))
    # StepLR as the original's (gamma 0.7); its step_size of 1 epoch is counted in optimizer steps here
    gamma, step_size = float(spec.option("gamma", 0.7)), int(spec.option("lr_step_steps", 20))
    torch.manual_seed(spec.seed)
    return Task(
        model=Net(int(spec.option("width", 8)), int(spec.option("hidden", 64)), size),
        train_set=SyntheticDigits(int(spec.option("train_size", 320)), size, spec.seed),
        eval_set=SyntheticDigits(int(spec.option("eval_size", 96)), size, spec.seed + 1),
        loss_fn=F.nll_loss,
        metric_fn=correct,
        metric_name="accuracy",
        optimizer_fn=lambda model: torch.optim.Adadelta(model.parameters(), lr=lr),
        scheduler_fn=lambda optimizer, total_steps: StepLR(optimizer, step_size=step_size, gamma=gamma),
    )
