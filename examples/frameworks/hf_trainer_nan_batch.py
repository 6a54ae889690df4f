"""A Hugging Face Trainer run whose training set holds one NaN sample.

The Trainer shuffles, so which step meets the sample depends on its sampler: the dataset prints
each sample index as the Trainer fetches it, and the step is the fetch position of sample 21
divided by (batch size x gradient_accumulation_steps). Under torchrun (the Trainer wraps the
model in DDP over gloo on CPU) each rank fetches its own samples and the line ends with its
rank. With ``bf16=True`` on CPU the run trains
under bfloat16 autocast: target bfloat16. The Trainer's log shows that step's loss as the
substitute ``logging_nan_inf_filter`` puts in (``'loss': '0'`` early in a run), while the
gradient norm is nan.

    python examples/frameworks/hf_trainer_nan_batch.py
    nanhunt diagnose examples/frameworks/hf_trainer_nan_batch.py
    python examples/frameworks/hf_trainer_nan_batch.py --callback OUT   # with NanhuntCallback

Options: ``--model mlp|bert`` (a 2-layer BERT built from a small config, no download),
``--accumulate N`` (``gradient_accumulation_steps``), ``--fp16-head`` (no autocast; the output
head is a ``.half()`` module whose weights overflow float16 from the first step: target float16
from the parameters), ``--tensorboard DIR``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

BAD_SAMPLE, N, BATCH = 21, 48, 4


class Samples(Dataset):
    def __init__(self, kind: str) -> None:
        g = torch.Generator().manual_seed(0)
        self.kind = kind
        self.x = torch.randn(N, 16, generator=g)
        self.ids = torch.randint(0, 50, (N, 8), generator=g)
        self.y = torch.randn(N, 1, generator=g)
        self.x[BAD_SAMPLE, 3] = float("nan")

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        # under torchrun each rank fetches its own shard of the samples: the line says whose
        rank = f" rank {os.environ['RANK']}" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        # (one write a line: two ranks share the pipe, and print writes the newline apart)
        sys.stderr.write(f"fetch {i}{rank}\n")
        if self.kind == "bert":  # the NaN rides in on the float inputs_embeds
            emb = torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
            if i == BAD_SAMPLE:
                emb[2, 5] = float("nan")
            return {"inputs_embeds": emb, "labels": self.y[i].squeeze(0)}
        return {"x": self.x[i], "labels": self.y[i]}


class MLP(nn.Module):
    def __init__(self, fp16_head: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)
        self.fp16_head = fp16_head
        if fp16_head:
            with torch.no_grad():
                self.head.weight.fill_(30000.0)  # a sum of 32 ReLU outputs x 30000: past 65504
            self.head.half()

    def forward(self, x, labels=None):
        h = self.body(x)
        out = self.head(h.half()).float() if self.fp16_head else self.head(h)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def build(kind: str, fp16_head: bool) -> nn.Module:
    if kind == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64, max_position_embeddings=16,
                         num_labels=1, problem_type="regression")
        return BertForSequenceClassification(cfg)
    return MLP(fp16_head)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["mlp", "bert"], default="mlp")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--fp16-head", action="store_true")
    p.add_argument("--callback", metavar="OUT")
    p.add_argument("--tensorboard", metavar="DIR")
    p.add_argument("--output-dir", default="hf-output")
    args = p.parse_args()

    torch.manual_seed(0)
    model = build(args.model, args.fp16_head)
    callbacks = []
    if args.callback:
        from nanhunt.integrations.transformers import NanhuntCallback

        callbacks.append(NanhuntCallback(out=args.callback, tensorboard=args.tensorboard or False))
    targs = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=BATCH, num_train_epochs=1,
        gradient_accumulation_steps=args.accumulate, use_cpu=True, bf16=not args.fp16_head,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, learning_rate=1e-3, seed=0,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Samples(args.model),
                      callbacks=callbacks)
    trainer.train()
    print(f"done global_step {trainer.state.global_step}")


if __name__ == "__main__":
    main()
