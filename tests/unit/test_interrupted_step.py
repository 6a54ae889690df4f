"""A step Ctrl-C cut between its backward and its optimizer step is no training result: its
gradients are still multiplied by GradScaler's scale, so their norm is not the step's gradient
norm and no rule may read an explosion into it."""

from __future__ import annotations

import torch
from torch import nn

import nanhunt
from nanhunt.pipeline import analyse
from nanhunt.trace import RunInfo


def _interrupted_run(cut_at: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    hunt = nanhunt.Hunt()
    hunt.start()
    try:
        for step in range(cut_at + 1):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            if step == cut_at:
                break  # where a KeyboardInterrupt would leave the loop
            scaler.step(opt)
            scaler.update()
    finally:
        hunt.stop()
    return hunt, model, scaler


def test_the_interrupted_steps_scaled_gradients_are_not_its_norm():
    hunt, model, _scaler = _interrupted_run(cut_at=6)
    steps = hunt.steps
    assert [s.index for s in steps] == list(range(7))  # the cut step is still a step
    assert steps[-1].loss is not None
    assert steps[-1].grad_norm is None  # no norm from gradients still scaled by 2^16
    # the finished steps' norms are the unscaled ones: an independent check on the last of them
    assert all(s.grad_norm is not None and s.grad_norm < 10 for s in steps[:-1])
    scaled = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad) for p in model.parameters()])).item()
    assert scaled > 100 * max(s.grad_norm for s in steps[:-1])  # what was reported before
    trace = analyse(hunt.trace(RunInfo(status="interrupted")))
    kinds = [w.kind for w in trace.warnings] + ([trace.diagnosis.kind] if trace.diagnosis else [])
    assert "exploding_gradient" not in kinds
    assert not any(r.type == "clip_grad_norm" for r in trace.recommendations)
