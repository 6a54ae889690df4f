"""nanhunt leaves the user's objects as they would be without it: a model and an optimizer
pickle, deep-copy and ``torch.save`` in every mode, and a pickled model carries none of
nanhunt's hooks (the file is the plain run's); module calls and optimizer steps from a thread
other than the training step's are not recorded into the step."""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt.precision._session import AuditSession


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 1))


MODES = {
    "watch": lambda m, o: nanhunt.Hunt(),
    "watch-given": lambda m, o: nanhunt.Hunt(m, o),
    "sampled": lambda m, o: nanhunt.Hunt(sample_every=2),
    "sentinel": lambda m, o: nanhunt.sentinel(out=None),
    "sentinel-given": lambda m, o: nanhunt.sentinel(m, o, out=None),
    "audit": lambda m, o: AuditSession(["float16"], steps=2, warmup=0, label="model"),
}


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("mode", list(MODES))
def test_model_and_optimizer_pickle_in_every_mode(mode):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session = MODES[mode](model, opt)
    with session:
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.randn(2, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            saved = _saved(model)  # the whole model, as word_language_model saves it
            twin = copy.deepcopy(model)
            pickle.loads(pickle.dumps(opt))
            copy.deepcopy(opt)
    # what was saved loads without nanhunt's hooks in it, and a copy carries none either
    loaded = torch.load(io.BytesIO(saved), weights_only=False)
    for m in (loaded, twin):
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert saved == _saved(model)  # the same bytes as once nanhunt is gone


def _eval_in_a_thread(model, stop: threading.Event, calls: list) -> None:
    with torch.no_grad():
        while not stop.is_set():
            model(torch.full((3, 4), 1e9))  # would overflow float16: not the training step's
            calls.append(1)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_module_calls_from_another_thread_are_not_recorded(mode):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stop, calls = threading.Event(), []
    session = nanhunt.Hunt(model, opt) if mode == "watch" else \
        nanhunt.sentinel(model, opt, out=None)
    with session:
        worker = threading.Thread(target=_eval_in_a_thread, args=(model, stop, calls))
        worker.start()
        try:
            for _ in range(6):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(2, 4)).float().pow(2).mean()
                loss.backward()
                opt.step()
                while len(calls) < 2:  # the other thread did call the model meanwhile
                    threading.Event().wait(0.001)
                calls.clear()
        finally:
            stop.set()
            worker.join()
    assert session.first_failure is None
    assert [s.index for s in session.steps] == list(range(6))  # its calls made no steps
    if mode == "watch":  # no record of the other thread's (huge) inputs
        assert all(layer.calls == 6 for layer in session.layers)
