"""nanoGPT's model trained on a Hugging Face ``datasets`` stream, in a script that keeps its own loop.

The model is ``examples/nanogpt_char.py``'s (nanoGPT's ``model.py``). The data is a stream of local JSON-lines
files (a ``text`` field per line), read with ``load_dataset("json", ..., streaming=True)``: no download, no
network. Each line's UTF-8 bytes are the tokens (a vocabulary of 256), packed into windows of ``block_size + 1``
(``idx`` and ``targets`` shifted by one), as multi-node LLM jobs read their corpora.

The session shards the stream over the ranks (``split_dataset_by_node``) and reads it through torchdata's
``StatefulDataLoader`` (its workers too): the stream's position is in every checkpoint and snapshot, so a resume
at the same world size goes on at the next window, exactly. A stream has no length: ``train.max_steps`` says how
long to train.

    PYTHONPATH=examples torchrun --standalone --nproc_per_node=2 examples/stream_gpt.py --data DIR \\
        --set train.max_steps=200 --set data.num_workers=2
    ddp-service launch --script examples/stream_gpt.py --set train.max_steps=200 -- --data DIR
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Any

import torch
from nanogpt_char import GPT, GPTConfig

import service


def windows(block_size: int) -> Any:
    """A batched ``map``: the batch's texts as bytes, one run, cut into windows of ``block_size + 1`` tokens (the
    tail that does not fill a window is dropped: windows never straddle two batches of lines)."""

    def pack(lines: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        tokens = [byte for text in lines["text"] for byte in (text + "\n").encode()]
        size = block_size + 1
        cut = [tokens[start : start + size] for start in range(0, len(tokens) - size + 1, size)]
        return {"idx": [window[:-1] for window in cut], "targets": [window[1:] for window in cut]}

    return pack


def main() -> None:
    with service.Session() as s:  # --config FILE and --set KEY=VALUE from the command line
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--data", required=True, help="a folder of *.jsonl files, a 'text' field per line")
        parser.add_argument("--block_size", type=int, default=32)
        parser.add_argument("--batch_size", type=int, default=8)
        parser.add_argument("--n_layer", type=int, default=2)
        parser.add_argument("--n_embd", type=int, default=32)
        parser.add_argument("--learning_rate", type=float, default=3e-3)
        args = parser.parse_args()

        from datasets import load_dataset

        files = sorted(glob.glob(os.path.join(args.data, "*.jsonl")))
        if not files:
            raise SystemExit(f"error: no *.jsonl file in {args.data}")
        stream = load_dataset("json", data_files=files, split="train", streaming=True)
        stream = stream.map(windows(args.block_size), batched=True, remove_columns=["text"]).with_format("torch")

        torch.manual_seed(s.config.seed)
        config = GPTConfig(block_size=args.block_size, vocab_size=256, n_layer=args.n_layer, n_head=2,
                           n_embd=args.n_embd, dropout=0.0, bias=False)  # fmt: skip
        model = s.model(GPT(config))
        optimizer = s.unwrap(model).configure_optimizers(0.1, args.learning_rate, (0.9, 0.99), s.device.type)
        s.keep(model=model, optimizer=optimizer)
        for batch in s.batches(stream, batch_size=args.batch_size):
            _, loss = model(batch["idx"], batch["targets"])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            s.log(loss=loss.detach())


if __name__ == "__main__":
    main()
