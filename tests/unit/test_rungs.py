"""The experiment ladder's whole-program fixes (nanhunt.experiment.rungs), each applied from outside
to a float16 run and checked against the path the script spells out by hand (its own float32,
bfloat16, no-scaler and replaced-input paths): the same losses, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fixes import run_script

from nanhunt.fixspec import SnippetContext, parse_fix, snippet

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "precision_paths.py"


def losses(args: list[str], fixes: list[str] = ()) -> list[float]:
    return [float(line.split()[-1]) for line in run_script(SCRIPT, args, fixes=fixes)]


@pytest.mark.parametrize("style", ["autocast", "half"])
def test_fp32_all_is_the_scripts_own_float32_path(style):
    reference = losses(["--style", style, "--dtype", "float32"])
    fixed = losses(["--style", style], fixes=["fp32-all"])
    assert fixed == reference
    assert losses(["--style", style]) != reference  # the float16 run differs


@pytest.mark.parametrize("style", ["autocast", "half"])
def test_bf16_is_the_scripts_own_bfloat16_path(style):
    extra = ["--scaler", "on"] if style == "autocast" else []  # bf16 keeps the loop's scaler
    assert losses(["--style", style], fixes=["bf16"]) == \
        losses(["--style", style, "--dtype", "bfloat16", *extra])


def test_no_scaler_is_the_scripts_own_path_without_a_scaler():
    assert losses([], fixes=["no-scaler"]) == losses(["--scaler", "off"])


@pytest.mark.parametrize("style", ["autocast", "half"])
def test_skip_batch_gives_the_model_the_previous_input(style):
    assert losses(["--style", style], fixes=["skip-batch=3"]) == \
        losses(["--style", style, "--replace-input", "3"])


MASKED = """
import sys
import torch
from torch import nn

class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.score, self.head = nn.Linear(4, 1), nn.Linear(4, 2)
    def forward(self, x, pad):  # attention pooling over a set, padding masked out
        s = self.score(x).squeeze(-1).masked_fill(pad, float("-inf"))
        return self.head((torch.softmax(s, dim=-1).unsqueeze(-1) * x).sum(1))

replace = int(sys.argv[1]) if len(sys.argv) > 1 else -1
row = len(sys.argv) > 2  # the script's own path: row 1 of step `replace` from row 0
model = Pool()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches = []
for step in range(4):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(3, 5, 4, generator=g), torch.tensor([0, 1, 0])
    pad = torch.arange(5)[None, :] >= torch.tensor([5, 2, 4])[:, None]
    if step == 2:
        pad[1] = True  # a set that is all padding: a softmax over -inf only is NaN
    batches.append((x, pad))
    if step == replace and row:
        x, pad = x.clone(), pad.clone()
        x[1], pad[1] = x[0].clone(), pad[0].clone()
        y = torch.tensor([0, 0, 0])  # the loss's labels: row 1 from row 0 too
    elif step == replace:  # the script's own path: the previous batch, the same labels
        x, pad = batches[step - 1]
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x, pad), y)
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}")
"""


def test_skip_batch_replaces_every_tensor_of_the_batch_a_mask_too(tmp_path):
    script = tmp_path / "masked.py"
    script.write_text(MASKED)

    def run(args, fixes=()):
        return [float(line.split()[-1]) for line in run_script(script, args, fixes=fixes)]

    assert run([])[2] != run([])[2]  # NaN: the fully padded set
    # the boolean mask is replaced with the features: the step the script takes by hand
    assert run([], fixes=["skip-batch=2"]) == run(["2"])
    # one sample: its row of the features and of the mask, from the batch's row 0
    assert run([], fixes=["skip-samples=2:1"]) == run(["2", "row"])
    assert run(["2", "row"]) != run(["2"])


def test_the_patches_are_gone_after_the_run():
    before = (torch.Tensor.half, torch.nn.Module.to, torch.amp.GradScaler.__init__,
              torch.amp.autocast_mode.autocast.__init__)
    losses([], fixes=["fp32-all", "skip-batch=2"])
    after = (torch.Tensor.half, torch.nn.Module.to, torch.amp.GradScaler.__init__,
             torch.amp.autocast_mode.autocast.__init__)
    assert before == after
    assert "half" not in torch.Tensor.__dict__ and "to" not in torch.Tensor.__dict__
    assert torch.ones(1).half().dtype == torch.float16


@pytest.mark.parametrize("text", ["fp32-all", "bf16", "no-scaler", "skip-batch=4",
                                  "skip-samples=4:1,7", "skip-samples=0:3"])
def test_specs_round_trip_and_have_a_snippet(text):
    spec = parse_fix(text)
    assert str(spec) == text
    assert snippet([spec], SnippetContext(device="cpu")).code


def test_skip_batch_is_a_whole_step():
    from nanhunt.errors import NanhuntError

    with pytest.raises(NanhuntError, match="whole number"):
        parse_fix("skip-batch=1.5")


@pytest.mark.parametrize("text", ["skip-samples=3", "skip-samples=3:", "skip-samples=1.5:2",
                                  "skip-samples=3:a", "skip-samples=-1:2",
                                  "skip-samples=3:" + ",".join(map(str, range(101)))])
def test_a_malformed_skip_samples_is_one_line(text):
    from nanhunt.errors import NanhuntError

    with pytest.raises(NanhuntError, match=r"^--fix skip-samples") as info:
        parse_fix(text)
    assert "\n" not in str(info.value)


def test_skip_samples_rows_are_sorted_and_distinct():
    assert str(parse_fix("skip-samples=2: 7,1,7")) == "skip-samples=2:1,7"


ACCUMULATE = """
import sys
import torch
from torch import nn

replace = int(sys.argv[1]) if len(sys.argv) > 1 else -1
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
criterion = nn.MSELoss()  # a loss module: called outermost, with the model's output
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches = {}
for step in range(5):
    opt.zero_grad()
    for micro in range(2):  # gradient accumulation: two different micro-batches a step
        g = torch.Generator().manual_seed(10 * step + micro)
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)
        batches[step, micro] = x, y
        if step == replace:  # by hand: each micro-batch from the same one of the step before
            x, y = batches[step - 1, micro]
        loss = criterion(model(x), y) / 2
        loss.backward()
        print(f"step {step} micro {micro} loss {loss.item()!r}")
    opt.step()
"""


def test_skip_batch_replaces_each_micro_batch_and_a_loss_modules_targets(tmp_path):
    """Gradient accumulation with a loss module: each micro-batch of step N becomes the same
    micro-batch of step N-1 (by call order), its targets too at the loss module's call, and the
    logits the loss module gets stay the model's (with their graph): the script's own path."""
    script = tmp_path / "accumulate.py"
    script.write_text(ACCUMULATE)

    def run(args, fixes=()):
        return [float(line.split()[-1]) for line in run_script(script, args, fixes=fixes)]

    assert run([], fixes=["skip-batch=2"]) == run(["2"]) != run([])


KEYWORDS = """
import io
import copy
import sys
import torch
from torch import nn

class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.score, self.head = nn.Linear(4, 1), nn.Linear(4, 2)
    def forward(self, features, mask):  # attention pooling, the padding masked out
        s = self.score(features).squeeze(-1).masked_fill(mask, -1e4)
        return self.head((torch.softmax(s, dim=-1).unsqueeze(-1) * features).sum(1))

how = sys.argv[1] if len(sys.argv) > 1 else ""
torch.manual_seed(0)
model = Pool()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
prev = None
for step in range(4):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(3, 5, 4, generator=g), torch.tensor([0, 1, step % 2])
    mask = torch.arange(5)[None, :] >= torch.tensor([5, 2, 4 - step % 2])[:, None]
    if step == 2 and how == "batch":  # by hand: the batch of the step before, labels too
        x, mask, y = prev
    elif step == 2 and how == "row":  # by hand: row 1 from row 0
        x, mask, y = x.clone(), mask.clone(), y.clone()
        x[1], mask[1], y[1] = x[0].clone(), mask[0].clone(), y[0].clone()
    prev = x, mask, y
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(features=x, mask=mask), y)  # keywords only
    loss.backward()
    opt.step()
    torch.save(model, io.BytesIO())  # the whole model, pickled: no hook of nanhunt's in it
    assert not copy.deepcopy(model)._forward_pre_hooks
    print(f"step {step} loss {loss.item()!r}")
"""


@pytest.mark.parametrize(("fix", "by_hand"), [("skip-batch=2", "batch"),
                                              ("skip-samples=2:1", "row")])
def test_the_batch_rungs_replace_keyword_tensors_and_stay_out_of_a_pickle(tmp_path, fix,
                                                                           by_hand):
    """``model(features=x, mask=m)``: the keyword tensors are replaced as the positional ones
    are (the script's own replacement by hand), and the model pickles and copies without the
    rung's hook."""
    script = tmp_path / "keywords.py"
    script.write_text(KEYWORDS)

    def run(args, fixes=()):
        return [float(line.split()[-1]) for line in run_script(script, args, fixes=fixes)]

    assert run([], fixes=[fix]) == run([by_hand]) != run([])
