"""The re-run sandbox against the installed writers (torch, tensorboard, Lightning, transformers).

Each wrapped call is made the way scripts make it (positional and keyword arguments, defaults),
and must behave as without the sandbox apart from where it writes: no TypeError from an
argument the installed version does not have, no argument given twice.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nanhunt.experiment.sandbox import Sandbox


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    box = Sandbox(tmp_path / "scratch").install()
    yield box
    box.uninstall()


def _inside(path: str | os.PathLike, box: Sandbox) -> bool:
    return os.path.abspath(os.fspath(path)).startswith(str(box.scratch))


def test_torch_save_and_load_by_position_and_keyword(sandbox, tmp_path):
    torch.save({"a": torch.ones(2)}, "pos.pt")
    torch.save({"b": torch.zeros(2)}, f="kw.pt")
    assert not (tmp_path / "pos.pt").exists()
    assert not (tmp_path / "kw.pt").exists()
    assert torch.equal(torch.load("pos.pt")["a"], torch.ones(2))
    assert torch.equal(torch.load(f="kw.pt", weights_only=True)["b"], torch.zeros(2))
    assert sorted(p.name for p in sandbox.scratch.rglob("*.pt")) == ["kw.pt", "pos.pt"]


def test_summary_writer_positional_keyword_and_default(sandbox, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writers = [SummaryWriter("runs/x"), SummaryWriter(log_dir="runs/y"), SummaryWriter(),
               SummaryWriter(None, "-comment")]
    try:
        for w in writers:
            assert _inside(w.log_dir, sandbox), w.log_dir
        assert writers[0].log_dir.endswith(os.path.join("runs", "x"))
    finally:
        for w in writers:
            w.close()
    assert not (tmp_path / "runs").exists()


def test_lightning_trainer_root_dir(sandbox, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    given = pl.Trainer(default_root_dir="root", logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False)
    default = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    assert _inside(given.default_root_dir, sandbox)
    assert given.default_root_dir.endswith("root")
    assert _inside(default.default_root_dir, sandbox)


def test_transformers_training_arguments(sandbox, tmp_path):
    transformers = pytest.importorskip("transformers")
    import inspect

    names = inspect.signature(transformers.TrainingArguments.__init__).parameters
    positional = transformers.TrainingArguments("out-pos", use_cpu=True, report_to=[])
    keyword = transformers.TrainingArguments(output_dir="out-kw", use_cpu=True, report_to=[])
    default = transformers.TrainingArguments(use_cpu=True, report_to=[])
    for args in (positional, keyword, default):
        assert _inside(args.output_dir, sandbox), args.output_dir
    assert positional.output_dir.endswith("out-pos")
    if "logging_dir" in names:  # transformers 4: logging_dir is redirected too when given
        given = transformers.TrainingArguments(output_dir="o", logging_dir="logs", use_cpu=True,
                                               report_to=[])
        assert _inside(given.logging_dir, sandbox)
    assert not Path(tmp_path / "out-pos").exists()


def test_a_wrong_call_raises_as_without_the_sandbox(sandbox):
    from torch.utils.tensorboard import SummaryWriter

    with pytest.raises(TypeError) as inside:
        SummaryWriter("a", log_dir="b")
    sandbox.uninstall()
    with pytest.raises(TypeError) as outside:
        SummaryWriter("a", log_dir="b")
    assert str(inside.value) == str(outside.value)


def test_uninstall_restores_the_exact_objects(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    before = (torch.save, torch.load, SummaryWriter.__dict__["__init__"])
    box = Sandbox(tmp_path / "scratch").install()
    assert torch.save is not before[0]
    box.uninstall()
    assert (torch.save, torch.load, SummaryWriter.__dict__["__init__"]) == before
