"""A recurrent language model in the shape of pytorch/examples' ``word_language_model``, as a ddp-service task.

The model is that program's ``RNNModel``: an embedding, an LSTM or GRU
(``rnn_type``), a decoder, optionally tied weights, sequence-first tensors,
``forward(input, hidden)`` returning ``(log_softmax output, hidden)`` and
``init_hidden(bsz)``, trained with ``nn.NLLLoss``. Where the original cuts one
long token stream into ``bptt`` slices, the samples here are sentences of
different lengths, so the task brings a padding ``collate_fn`` (with the
lengths), a ``batch_size_fn`` (the batch is the second dimension) and an
``eval_fn`` with two metrics: per-sentence loss and next-word accuracy.

Run it with this folder on PYTHONPATH:

    PYTHONPATH=examples torchrun --standalone --nproc_per_node=2 -m service train examples/word_lm.yaml

This is a port of the model, not of the training: the original trains one
token stream with truncated BPTT (``batchify``, ``get_batch`` in order, the
hidden state carried from one slice to the next), and this task trains padded
sentences with a zero hidden state each batch. ``examples/word_lm_tbptt.py`` is
the faithful port, the original's ``main.py`` on the session API. What the
service does here: the device, ``train()``'s loop with ``clip_grad_norm_`` and
its own SGD update, ``evaluate()``'s totals (over the whole eval set across
ranks), the annealing of the learning rate on the validation loss
(``ReduceLROnPlateau``, stepped after each evaluation) and the best-model save.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import Dataset

from service.tasks.base import Task, TaskSpec

# --- the user's code, in its source's shape ---------------------------------------------------------------------


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type: str, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.5,
                 tie_weights: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type not in ("LSTM", "GRU"):
            raise ValueError(f"rnn_type must be 'LSTM' or 'GRU', not {rnn_type!r}.")
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError("When using the tied flag, nhid must be equal to emsize.")
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers

    def init_weights(self) -> None:
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input: Tensor, hidden: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | tuple]:
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> Tensor | tuple[Tensor, Tensor]:
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


class Sentences(Dataset):
    """Sentences of 4 to 12 word ids from a tiny grammar: each continues its start by a stride of 1 or 2.

    The stride is visible only from the second word on, so predicting the next
    word needs the recurrent state. Samples are 1-D LongTensors of different lengths.
    """

    def __init__(self, count: int, ntoken: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.samples = []
        for _ in range(count):
            length = int(torch.randint(4, 13, (), generator=gen))
            start, stride = torch.randint(0, ntoken, (), generator=gen), torch.randint(1, 3, (), generator=gen)
            self.samples.append((start + stride * torch.arange(length)) % ntoken)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Tensor:
        return self.samples[index]


# --- the task: the glue ---------------------------------------------------------------------------------------


class Batch(NamedTuple):
    input: Tensor  # (seq_len, batch), padded with 0
    targets: Tensor  # (seq_len, batch), padded with -100: NLLLoss's ignore_index
    lengths: Tensor  # (batch,)


def collate(samples: list[Tensor]) -> Batch:
    """Pad to the longest sentence, sequence-first (``pad_sequence``'s default, as the model wants)."""
    lengths = torch.tensor([len(s) - 1 for s in samples])
    return Batch(pad_sequence([s[:-1] for s in samples]), pad_sequence([s[1:] for s in samples], padding_value=-100),
                 lengths)  # fmt: skip


def build(spec: TaskSpec) -> Task:
    ntoken, nhid = int(spec.option("ntoken", 24)), int(spec.option("nhid", 32))
    torch.manual_seed(spec.seed)
    net = RNNModel(str(spec.option("rnn_type", "LSTM")), ntoken, nhid, nhid, 1, dropout=0.2, tie_weights=True)
    criterion = nn.NLLLoss()  # ignores the -100 padding: a unidirectional RNN's outputs before it are exact

    def step(model: nn.Module, batch: Batch) -> Tensor:  # model: the DDP wrapper; init_hidden lives on net
        output, _ = model(batch.input, net.init_hidden(batch.input.size(1)))
        return criterion(output, batch.targets.view(-1))

    def evaluate(model: RNNModel, batch: Batch) -> dict[str, Tensor]:
        output, _ = model(batch.input, model.init_hidden(batch.input.size(1)))
        nll = F.nll_loss(output, batch.targets.view(-1), reduction="none").view_as(batch.targets)  # 0 on padding
        hits = ((output.argmax(dim=1).view_as(batch.targets) == batch.targets) & (batch.targets != -100)).float()
        return {"loss": nll.sum(0) / batch.lengths, "accuracy": hits.sum(0) / batch.lengths}

    return Task(
        model=net,
        train_set=Sentences(int(spec.option("train_size", 384)), ntoken, spec.seed),
        eval_set=Sentences(int(spec.option("eval_size", 96)), ntoken, spec.seed + 1),
        step_fn=step,
        eval_fn=evaluate,
        collate_fn=collate,
        batch_size_fn=lambda batch: len(batch.lengths),
        optimizer_fn=lambda model: torch.optim.SGD(model.parameters(), lr=float(spec.option("lr", 20.0))),
        # main.py's "lr /= 4.0 if no improvement has been seen in the validation dataset", after each evaluation
        scheduler_fn=lambda optimizer, total_steps: ReduceLROnPlateau(optimizer, factor=0.25, patience=0),
        tokens_fn=lambda batch: int(batch.lengths.sum()),
    )
