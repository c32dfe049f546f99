"""Tasks in the shapes real training code has: dict batches, a model that computes its own loss, its own
optimizer and schedule, variable-length samples; and one task per interface mistake the service must explain.
"""

from __future__ import annotations

import collections
import time

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from service.tasks.base import Task, TaskSpec

VOCAB = 16


class Tokens(Dataset):
    """Dict samples of a fixed-length next-token problem: the target is the input shifted by one."""

    def __init__(self, count: int, length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (count, 1), generator=generator)
        step = torch.randint(1, 3, (count, 1), generator=generator)
        self.data = (start + step * torch.arange(length + 1)) % VOCAB

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        row = self.data[index]
        return {"idx": row[:-1], "targets": row[1:]}


class TinyLM(nn.Module):
    """``forward(idx, targets) -> (logits, loss)``, tied embedding and head, as GPT-style code is written."""

    def __init__(self, width: int = 16, sleep: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.sleep = sleep

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if self.sleep and self.training:
            time.sleep(self.sleep)
        hidden = self.norm(torch.tanh(self.mix(self.embed(idx))))
        logits = self.head(hidden)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    def configure_optimizers(self, weight_decay: float, lr: float, betas: tuple[float, float]) -> torch.optim.AdamW:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=betas)


def _lm_eval(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    logits, _ = model(batch["idx"])
    per_token = F.cross_entropy(logits.transpose(1, 2), batch["targets"], reduction="none")
    correct = (logits.argmax(-1) == batch["targets"]).float()
    return {"loss": per_token.mean(1), "token_accuracy": correct.mean(1)}


def dict_lm(spec: TaskSpec) -> Task:
    """Dict batches, ``step_fn`` on a model that returns (logits, loss), its own AdamW groups and StepLR."""
    torch.manual_seed(spec.seed)
    count = int(spec.option("train_size", 96))
    return Task(
        model=TinyLM(sleep=float(spec.option("sleep", 0.0))),
        train_set=Tokens(count, 8, spec.seed),
        eval_set=Tokens(24, 8, spec.seed + 1),
        step_fn=lambda model, batch: model(batch["idx"], batch["targets"])[1],
        eval_fn=_lm_eval,
        optimizer_fn=lambda module: module.configure_optimizers(0.1, 3e-3, (0.9, 0.95)),
        scheduler_fn=lambda optimizer, total: torch.optim.lr_scheduler.StepLR(optimizer, max(1, total // 3), 0.5),
        tokens_fn=lambda batch: int(batch["idx"].numel()),
    )


class VarLen(Dataset):
    """Samples of 2 to 9 tokens; the label is whether the sequence sums to an even number."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, 10, (count,), generator=generator)
        self.items = [torch.randint(0, VOCAB, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.items[index], int(self.items[index].sum()) % 2


Padded = collections.namedtuple("Padded", ["tokens", "lengths", "labels"])


def pad(samples: list[tuple[Tensor, int]]) -> Padded:
    tokens = nn.utils.rnn.pad_sequence([tokens for tokens, _ in samples], batch_first=True)
    return Padded(tokens, torch.tensor([len(t) for t, _ in samples]), torch.tensor([y for _, y in samples]))


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        mask = (torch.arange(tokens.shape[1]) < lengths[:, None]).float()
        pooled = (self.embed(tokens) * mask[..., None]).sum(1) / lengths[:, None]
        return self.out(pooled)


def varlen(spec: TaskSpec) -> Task:
    """Variable-length samples through a padding ``collate_fn`` into a namedtuple batch; two eval metrics."""

    def evaluate(model: nn.Module, batch: Padded) -> dict[str, Tensor]:
        logits = model(batch.tokens, batch.lengths)
        return {"loss": F.cross_entropy(logits, batch.labels, reduction="none"),
                "accuracy": (logits.argmax(1) == batch.labels).float()}  # fmt: skip

    torch.manual_seed(spec.seed)
    return Task(
        model=Pooled(),
        train_set=VarLen(int(spec.option("train_size", 64)), spec.seed),
        eval_set=VarLen(20, spec.seed + 1),
        step_fn=lambda model, batch: F.cross_entropy(model(batch.tokens, batch.lengths), batch.labels),
        collate_fn=pad,
        eval_fn=evaluate,
    )


# ---------------------------------------------------------------- one task per interface mistake


def _lm_task(**fields: object) -> Task:
    torch.manual_seed(0)
    base = {"model": TinyLM(), "train_set": Tokens(32, 8, 0), "eval_set": Tokens(8, 8, 1)}
    return Task(**{**base, **fields})  # type: ignore[arg-type]


def step_returns_tuple(spec: TaskSpec) -> Task:
    return _lm_task(step_fn=lambda model, batch: model(batch["idx"], batch["targets"]))


def loss_not_reduced(spec: TaskSpec) -> Task:
    def step(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        logits, _ = model(batch["idx"])
        return F.cross_entropy(logits.transpose(1, 2), batch["targets"], reduction="none")

    return _lm_task(step_fn=step)


def loss_without_grad(spec: TaskSpec) -> Task:
    return _lm_task(step_fn=lambda model, batch: model(batch["idx"], batch["targets"])[1].detach())


def dict_batch_without_step(spec: TaskSpec) -> Task:
    return _lm_task(loss_fn=F.cross_entropy)


class NoTensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> dict[str, str]:
        self.linear(x)
        return {"status": "done"}


class Pairs(Dataset):
    def __init__(self, shapes: list[int] | None = None) -> None:
        self.shapes = shapes or [4] * 16

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return torch.ones(self.shapes[index]), index % 2


def output_without_tensors(spec: TaskSpec) -> Task:
    return Task(NoTensors(), Pairs(), Pairs(), loss_fn=F.cross_entropy)


def unequal_samples(spec: TaskSpec) -> Task:
    return Task(nn.Linear(4, 2), Pairs([4, 5] * 8), Pairs(), loss_fn=F.cross_entropy)


class Record:
    def __init__(self, value: float) -> None:
        self.value = value


class Records(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> Record:
        return Record(float(index))


def object_samples(spec: TaskSpec) -> Task:
    return Task(nn.Linear(1, 1), Records(), Records(), step_fn=lambda model, batch: model(batch).mean())


class SharedBuffer(nn.Module):
    """A positional table registered as an expanded view: its rows share one memory location."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.register_buffer("position", torch.arange(4.0).expand(16, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x + self.position[: len(x)])


def shared_buffer(spec: TaskSpec) -> Task:
    return Task(SharedBuffer(), Pairs(), Pairs(), loss_fn=F.cross_entropy)


class StepCounter:
    """State a task keeps beside its model (``Task.state``): the steps its ``step_fn`` has run, kept and restored."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])


def lm_with_state(spec: TaskSpec) -> Task:
    """``dict_lm`` with a ``Task.state`` counter its ``step_fn`` advances, and ``step_fn`` returning
    ``(loss, {name: number})``: the counter and the loss doubled are logged beside the loss."""
    counter = StepCounter()

    def step(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, object]]:
        counter.steps += 1
        loss = model(batch["idx"], batch["targets"])[1]
        return loss, {"counted": float(counter.steps), "twice": loss.detach() * 2}

    task = dict_lm(spec)
    return Task(model=task.model, train_set=task.train_set, eval_set=task.eval_set, step_fn=step,
                eval_fn=_lm_eval, optimizer_fn=task.optimizer_fn, state={"counter": counter})  # fmt: skip
