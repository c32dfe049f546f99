"""A character-level GPT in the shape of nanoGPT's ``model.py``, as a ddp-service task.

The model is nanoGPT's: ``GPTConfig``, pre-norm ``Block``s of causal
self-attention and an MLP, the token embedding tied to ``lm_head``,
``forward(idx, targets)`` returning ``(logits, loss)``, and its own
``configure_optimizers`` (weight decay on the 2-D weights only, AdamW betas).
``train.py``'s cosine learning rate with warm-up is the scheduler. The data is
a few KB of text built in (``shakespeare_char``'s shape: one token per
character), fed as dict batches ``{"idx": ..., "targets": ...}``.

Run it with this folder on PYTHONPATH:

    PYTHONPATH=examples torchrun --standalone --nproc_per_node=2 -m service train examples/nanogpt.yaml

What nanoGPT's ``train.py`` did and the service now does: ``init_process_group``
and the device, ``get_batch`` (here: a map-style dataset of windows, sharded and
resumable), gradient accumulation with ``require_backward_grad_sync`` on the
last micro-step only, ``grad_clip``, the ``GradScaler``/autocast context,
``estimate_loss`` (exact over the eval set), checkpoints and ``init_from='resume'``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Dataset

from service.tasks.base import Task, TaskSpec

# --- the user's code, in its source's shape ---------------------------------------------------------------------


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no ``bias=False`` before 2.1)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: Tensor) -> Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclasses.dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # scaled init of the residual projections, per GPT-2
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        b, t = idx.size()
        assert t <= self.config.block_size, (
            f"Cannot forward sequence of length {t}, block size {self.config.block_size}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        tok_emb = self.transformer.wte(idx)  # (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:  # inference: only the last position's logits
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float],
                             device_type: str) -> torch.optim.AdamW:  # fmt: skip
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        # Every 2-D parameter (matmul weights, embeddings) decays; biases and layernorms do not.
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)


TEXT = """\
First Trainer:
Speak, what step is this? The loss is falling fast,
and every rank has seen its share of the data.

Second Trainer:
Nay, not every rank: the second lost its node,
and we must wait upon the checkpoint's word.

First Trainer:
Then wait. The checkpoint knows the step, the seed,
the cursor of the epoch and the moments of the optimizer;
what it restores, it restores to the last bit.

Second Trainer:
To the last bit? Even when the world grows smaller?

First Trainer:
Even then. The global batch is kept; the micro-steps
are counted out again, and no sample is seen twice
or lost between the sleeping and the waking.

Second Trainer:
I have heard of runs that woke and trained anew
upon the same first samples they had seen,
and ended with a model none could reproduce.

First Trainer:
Those had no plan. A plan is a permutation
fixed by the seed and the epoch, and a cursor;
the step takes the next slice of it, whatever world it runs in.

Second Trainer:
And gradients? Two ranks add two numbers,
but three add three, and in what order?

First Trainer:
In the order of the buckets, which settle
once before the first step, so every start agrees.

Second Trainer:
You make it sound so simple. Shall we train?

First Trainer:
We shall. Bring your model as it is:
its forward, its loss, its optimizer and its schedule.
The service brings the rest: the sampler and the wrapper,
the no_sync of the accumulating steps,
the clipping of the norm, the saving and the resuming.
"""


class CharDataset(Dataset):
    """Every ``block_size`` window of the encoded text: ``{"idx": x, "targets": x shifted by one}``.

    ``train.py``'s ``get_batch`` draws random offsets itself; a map-style dataset lets
    the service's sampler choose them, so a resumed run draws the same ones.
    """

    def __init__(self, data: Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"idx": self.data[i : i + self.block_size], "targets": self.data[i + 1 : i + 1 + self.block_size]}


def get_lr(it: int, learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    """``train.py``'s learning rate: linear warm-up, then cosine decay down to ``min_lr``."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


# --- the task: the glue ---------------------------------------------------------------------------------------


def step(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(batch["idx"], batch["targets"])[1]  # the loss of (logits, loss)


def evaluate(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    logits, _ = model(batch["idx"], batch["targets"])
    per_token = F.cross_entropy(logits.transpose(1, 2), batch["targets"], reduction="none")  # (batch, block)
    hits = (logits.argmax(dim=-1) == batch["targets"]).float()
    return {"loss": per_token.mean(dim=1), "accuracy": hits.mean(dim=1)}


def build(spec: TaskSpec) -> Task:
    block_size, lr = int(spec.option("block_size", 32)), float(spec.option("learning_rate", 1e-2))
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT], dtype=torch.long)
    split = int(0.9 * len(data))
    config = GPTConfig(block_size=block_size, vocab_size=len(chars), n_layer=int(spec.option("n_layer", 2)),
                       n_head=2, n_embd=int(spec.option("n_embd", 32)), dropout=float(spec.option("dropout", 0.1)),
                       bias=False)  # fmt: skip
    torch.manual_seed(spec.seed)
    betas, warmup = (0.9, 0.99), int(spec.option("warmup_iters", 4))
    return Task(
        model=GPT(config),
        train_set=CharDataset(data[:split], block_size),
        eval_set=CharDataset(data[split:], block_size),
        step_fn=step,
        eval_fn=evaluate,
        optimizer_fn=lambda gpt: gpt.configure_optimizers(0.1, lr, betas, next(gpt.parameters()).device.type),
        scheduler_fn=lambda optimizer, total_steps: LambdaLR(
            optimizer, lambda it: get_lr(it, lr, warmup, total_steps, lr / 10) / lr
        ),
        tokens_fn=lambda batch: batch["idx"].numel(),
    )
