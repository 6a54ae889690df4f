"""Shared parts of the loss-curve scripts (curves_gpt.py, curves_vit.py, curves_encoder.py):
tiny transformers and one training loop whose flags make each failure without NaN and its
healthy controls. Not a nanhunt import: ordinary torch.

Flags (every script): --steps N, --lr X, --optim adam|sgd, --precision fp32|bf16|fp16 (autocast;
fp16 adds a GradScaler), --weights fp32|bf16 (the model's own parameters), --post-ln, --warmup N
(linear lr warm-up), --restarts T (cosine with warm restarts every T steps), --qk-norm,
--z-loss C, --clip C, --growth-interval N (GradScaler's), --spike-at S (one bad update at step S:
its lr x --spike-lr, 30 by default), --seed N, --hot SUFFIX --hot-lr X (the modules whose
names end with SUFFIX in a param group of their own, with lr X).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn


def parse(argv: list[str] | None = None, **defaults: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optim", default="adam", choices=("adam", "sgd"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--weights", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--post-ln", action="store_true")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--restarts", type=int, default=0)
    p.add_argument("--qk-norm", action="store_true")
    p.add_argument("--z-loss", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--growth-interval", type=int, default=2000)
    p.add_argument("--init-scale", type=float, default=2.0**16)
    p.add_argument("--spike-at", type=int, default=-1)
    p.add_argument("--spike-lr", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hot", default="", help="modules (name suffix) in a param group of their own")
    p.add_argument("--hot-lr", type=float, default=0.0, help="that group's lr")
    p.set_defaults(**defaults)
    return p.parse_args(argv)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool, qk_norm: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.q_norm = nn.LayerNorm(d // heads) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(d // heads) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        q, k = self.q_norm(q), self.k_norm(k)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        if self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(mask, float("-inf"))
        y = att.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool, post_ln: bool, qk_norm: bool) -> None:
        super().__init__()
        self.post_ln = post_ln
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, causal, qk_norm)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_ln:
            x = self.ln1(x + self.attn(x))
            return self.ln2(x + self.mlp(x))
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Trunk(nn.Module):
    def __init__(self, d: int, heads: int, depth: int, causal: bool, post_ln: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads, causal, post_ln, qk_norm)
                                    for _ in range(depth))
        self.ln_f = nn.Identity() if post_ln else nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def train(args: argparse.Namespace, model: nn.Module, batch, loss_fn=None) -> None:
    """``batch(step, generator) -> (inputs, targets)``; the loss is cross-entropy of the model's
    logits (last dim) against the targets, plus the z-loss when asked."""
    if args.weights == "bf16":
        model.to(torch.bfloat16)
    hot = [p for n, m in model.named_modules() if args.hot and n.endswith(args.hot)
           for p in m.parameters()]
    rest = [p for p in model.parameters() if all(p is not q for q in hot)]
    groups = [{"params": rest}] + ([{"params": hot, "lr": args.hot_lr}] if hot else [])
    if args.optim == "adam":
        opt = torch.optim.Adam(groups, lr=args.lr)
    else:
        opt = torch.optim.SGD(groups, lr=args.lr)
    sched = None
    if args.warmup:
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / args.warmup))
    elif args.restarts:
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=args.restarts)
    fp16 = args.precision == "fp16"
    scaler = torch.amp.GradScaler("cpu", enabled=fp16, init_scale=args.init_scale,
                                  growth_interval=args.growth_interval)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    g = torch.Generator().manual_seed(1000 + args.seed)
    for step in range(args.steps):
        x, y = batch(step, g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(x)
            logits = logits.reshape(-1, logits.shape[-1]).float()
            loss = F.cross_entropy(logits, y.reshape(-1))
            if args.z_loss:
                loss = loss + args.z_loss * logits.logsumexp(-1).pow(2).mean()
        scaler.scale(loss).backward()
        if args.clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if step == args.spike_at:  # one bad update: the loss spikes at the next step
            for group in opt.param_groups:
                group["lr"] *= args.spike_lr
        scaler.step(opt)
        if step == args.spike_at:
            for group in opt.param_groups:
                group["lr"] /= args.spike_lr
        scaler.update()
        if sched is not None:
            sched.step()
        print(f"step {step} loss {loss.item():.6g}", flush=True)
