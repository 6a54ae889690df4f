"""Shared fixtures: every test must leave torch's global hook tables as it found them."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.nn.modules import module as _M
from torch.optim import optimizer as _O

# one torch thread in this process: the CLI runs of tests/integration (two at a time) share the
# machine with it, and a thread per core here made in-process tests up to 11x slower under load;
# results never depend on it (the CLI children run with OMP_NUM_THREADS=1 too)
torch.set_num_threads(1)


def global_hook_counts() -> dict[str, int]:
    # _global_forward_hooks_with_kwargs keeps stale ids after remove(): not counted
    return {
        "fwd_pre": len(_M._global_forward_pre_hooks),
        "fwd": len(_M._global_forward_hooks),
        "bwd_pre": len(_M._global_backward_pre_hooks),
        "bwd": len(_M._global_backward_hooks),
        "optim_pre": len(_O._global_optimizer_pre_hooks),
        "optim_post": len(_O._global_optimizer_post_hooks),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "function_modes": torch._C._len_torch_function_stack(),
    }


def _patched_methods() -> dict[str, object]:
    return {
        "Tensor.backward": torch.Tensor.__dict__["backward"],
        "GradScaler.scale": torch.amp.GradScaler.__dict__["scale"],
        "GradScaler.update": torch.amp.GradScaler.__dict__["update"],
        "GradScaler.unscale_": torch.amp.GradScaler.__dict__["unscale_"],
        "GradScaler.step": torch.amp.GradScaler.__dict__["step"],
        "clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "Optimizer.__init__": torch.optim.Optimizer.__dict__["__init__"],
        "clip_grad.clip_grad_norm_": torch.nn.utils.clip_grad.clip_grad_norm_,
    }


@pytest.fixture(autouse=True)
def _no_leaked_hooks():
    before, patched = global_hook_counts(), _patched_methods()
    yield
    assert global_hook_counts() == before, "a test left a global hook or mode behind"
    assert _patched_methods() == patched, "a test left a patched torch method behind"
    import nanhunt.capture as cap

    assert cap._ACTIVE is None, "a test left a nanhunt session active"
    # a framework callback's summary waits for the process's end: not the test run's
    session_mod = sys.modules.get("nanhunt.integrations._session")
    if session_mod is not None:
        session_mod._pending.clear()


def pytest_collection_modifyitems(config, items):
    # unit tests first: meanwhile the integration tests' shared CLI runs, started when collection
    # ends (tests/integration/conftest.py), use the second core (a stable sort: each module's
    # tests stay together and in order)
    items.sort(key=lambda item: "integration" in item.path.parts)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session):
    # the fork servers of tests/clirun.py (started by the first test that runs a CLI)
    from clirun import close_fork_servers

    close_fork_servers()
