"""Causal language modelling without a Trainer, in a script that keeps its own loop: a port of the structure of
transformers' ``examples/pytorch/language-modeling/run_clm_no_trainer.py`` (an Accelerate script) to
``service.Session``, written anew after it (its text is not copied here; docs/porting.md maps each Accelerate call).

As upstream: the arguments (the same names), the raw text split into train and validation by
``--validation_split_percentage``, ``tokenize_function`` then ``group_texts`` (blocks of ``--block_size`` tokens,
``labels`` = ``input_ids``) as batched ``datasets`` maps, AdamW over two parameter groups (no weight decay on
biases and LayerNorm weights), ``get_scheduler``, an epoch loop of optimizer steps, and after each epoch the
evaluation's perplexity. Here, with no network: a tiny GPT-2 built from a ``GPT2Config`` (no pretrained weights)
and a word-level tokenizer built from the training text (no hub). ``--streaming`` reads the text file as a
``datasets`` stream (then ``--set train.max_steps=N`` says how long to train).

    torchrun --standalone --nproc_per_node=2 examples/clm_no_trainer.py --train_file corpus.txt --block_size 16
    ddp-service launch --script examples/clm_no_trainer.py -- --train_file corpus.txt

What changed from an Accelerate script: ``Accelerator()`` is ``service.Session()``; ``accelerator.prepare`` is
``s.model`` for the model and ``s.batches``/``s.eval_batches`` for the loaders; ``accelerator.accumulate`` and
``backward`` are ``s.micro_batches`` and ``s.backward`` (``--set train.grad_accum=k``); ``range(num_train_epochs)``
is ``s.epochs(num_train_epochs)``; ``accelerator.gather`` of the eval losses is ``s.sum``; ``save_state`` and
``--resume_from_checkpoint`` are ``s.keep`` once. The scheduler counts optimizer steps (no ``× num_processes``).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from typing import Any

import datasets
import torch
import transformers
from datasets import DatasetDict, load_dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, default_data_collator, get_scheduler

import service

logger = logging.getLogger(__name__)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a tiny GPT-2 on a local text file, as run_clm_no_trainer.py")
    parser.add_argument("--train_file", type=str, required=True, help="a text file, one text per line")
    parser.add_argument("--validation_file", type=str, default=None, help="a text file for the evaluation")
    parser.add_argument(
        "--validation_split_percentage",
        type=int,
        default=5,
        help="the share of the train file held out for the evaluation, without --validation_file",
    )
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument(
        "--max_train_steps",
        type=int,
        default=None,
        help="the schedule's length; the run's own limit is --set train.max_steps",
    )
    parser.add_argument("--lr_scheduler_type", type=str, default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", type=str, default=None, help="where to save the final model")
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--streaming", action="store_true", help="read the train file as a datasets stream")
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_head", type=int, default=2)
    parser.add_argument("--n_embd", type=int, default=32)
    return parser.parse_args()


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the training text's words (sorted: the same ids on every rank), built here."""
    words = sorted({word for text in texts for word in text.split()})
    vocab = {word: index for index, word in enumerate(["<unk>", "<eos>", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")


def main() -> None:
    with service.Session() as s:  # --config FILE and --set KEY=VALUE from the command line
        args = parse_args()
        logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=s.log_level)
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()

        data_files = {"train": args.train_file}
        if args.validation_file is not None:
            data_files["validation"] = args.validation_file
        with s.main_first():  # rank 0 builds the datasets cache, the others read it
            raw_datasets: Any = load_dataset("text", data_files=data_files)
            if "validation" not in raw_datasets:
                percent = args.validation_split_percentage
                raw_datasets = DatasetDict({
                    "validation": load_dataset("text", data_files=data_files, split=f"train[:{percent}%]"),
                    "train": load_dataset("text", data_files=data_files, split=f"train[{percent}%:]"),
                })  # fmt: skip
        tokenizer = build_tokenizer(raw_datasets["train"]["text"])

        torch.manual_seed(s.config.seed)
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.block_size, n_embd=args.n_embd,
                            n_layer=args.n_layer, n_head=args.n_head, bos_token_id=tokenizer.eos_token_id,
                            eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        model = GPT2LMHeadModel(config)

        def tokenize_function(examples: dict[str, list[str]]) -> Any:
            return tokenizer([text + " <eos>" for text in examples["text"]])

        block_size = args.block_size

        def group_texts(examples: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
            """The batch's token ids in one run, cut into blocks of block_size (the remainder is dropped)."""
            joined = {key: [token for row in rows for token in row] for key, rows in examples.items()}
            total = len(joined["input_ids"]) // block_size * block_size
            result = {key: [ids[i : i + block_size] for i in range(0, total, block_size)]
                      for key, ids in joined.items()}  # fmt: skip
            result["labels"] = [list(block) for block in result["input_ids"]]
            return result

        with s.main_first():
            lm_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=["text"]).map(
                group_texts, batched=True
            )
        train_dataset, eval_dataset = lm_datasets["train"], lm_datasets["validation"]
        if args.streaming:  # the same file as a stream: no length, read as it goes (train.max_steps bounds it)
            stream = load_dataset("text", data_files={"train": args.train_file}, split="train", streaming=True)
            train_dataset = stream.map(tokenize_function, batched=True, remove_columns=["text"]).map(
                group_texts, batched=True
            )

        model = s.model(model)
        no_decay = ["bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
        optimizer_grouped_parameters = [
            {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
             "weight_decay": args.weight_decay},
            {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
        ]  # fmt: skip
        optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

        # The schedule counts optimizer steps: an s.batches step is one, whatever train.grad_accum is.
        steps_per_epoch = len(lm_datasets["train"]) // (args.per_device_train_batch_size * s.world_size)
        max_train_steps = args.max_train_steps or s.config.train.max_steps or args.num_train_epochs * steps_per_epoch
        lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                     num_warmup_steps=args.num_warmup_steps,
                                     num_training_steps=max_train_steps)  # fmt: skip
        s.keep(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)

        logger.info("***** Running training *****")
        logger.info(f"  Num examples = {len(lm_datasets['train'])}, Num Epochs = {args.num_train_epochs}")
        logger.info(f"  Total train batch size = {args.per_device_train_batch_size * s.world_size}")
        logger.info(f"  Total optimization steps = {max_train_steps}, resuming at {s.global_step}")

        for epoch in s.epochs(args.num_train_epochs):
            model.train()
            for batch in s.batches(train_dataset, args.per_device_train_batch_size, collate_fn=default_data_collator):
                for micro_batch in s.micro_batches(batch):
                    with s.autocast():
                        outputs = model(**micro_batch)
                    s.backward(outputs.loss)
                s.step(optimizer)
                lr_scheduler.step()
                optimizer.zero_grad()
                s.log(loss=outputs.loss.detach())

            model.eval()
            total, count = 0.0, 0
            with torch.no_grad():
                for batch in s.eval_batches(eval_dataset, args.per_device_eval_batch_size, default_data_collator):
                    outputs = model(**batch)
                    total += float(outputs.loss) * len(batch["input_ids"])
                    count += len(batch["input_ids"])
            eval_loss = s.sum(total) / max(s.sum(count), 1)
            try:
                perplexity = math.exp(eval_loss)
            except OverflowError:
                perplexity = float("inf")
            s.print(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
            s.log(perplexity=perplexity, eval_loss=eval_loss)

        if args.output_dir is not None:
            s.barrier()
            os.makedirs(args.output_dir, exist_ok=True)
            s.unwrap(model).save_pretrained(args.output_dir, is_main_process=s.rank == 0)
            tokenizer.save_pretrained(args.output_dir, is_main_process=s.rank == 0)


if __name__ == "__main__":
    main()
