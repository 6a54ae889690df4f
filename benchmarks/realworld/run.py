#!/usr/bin/env python
"""Run public training scripts, unmodified, under every nanhunt mode and check its promises.

Each corpus entry is a public training script (its files pinned by sha256 in ``ENTRIES``),
made to run offline on CPU only through its own options and a small synthetic data set that
``prepare`` writes into a scratch copy. Each entry runs *healthy* and with a *failure* driven
through its own options, under plain ``python`` (the reference) and under nanhunt:

  full       nanhunt diagnose --verify 0
  keepgoing  nanhunt diagnose --verify 0 --keep-going (failure only: the whole run's outputs)
  sentinel   nanhunt diagnose --mode sentinel --verify 0
  sample     nanhunt diagnose --sample-every 3 --verify 0
  audit      nanhunt audit (healthy only)
  fix        nanhunt diagnose --fix SPEC --verify 0 (failure only)
  verify     nanhunt diagnose --verify 2 --jobs 1 (failure only: the re-runs must not crash)

and checks: exit codes; stdout and stderr identical to the plain run apart from nanhunt's own
lines (a prefix of it when nanhunt stopped the script at the failure); output files
(checkpoints, logs) bit-identical; the step count against an independent counter
(``count_steps.py``); the target format; the failure's step, phase and module against an
independent TorchDispatchMode locator (``benchmarks/redteam/tools/locate_first.py``); fix
re-runs that do not crash.

The scripts' sources are not part of this repository: see README.md for where they come from
and how to put them in ``sources/``. Usage::

    OMP_NUM_THREADS=1 python benchmarks/realworld/run.py [--only NAME ...] [--modes M ...]
        [--variants healthy|failure ...] [--fast] [--json results.json] [--work DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SOURCES = HERE / "sources"
STANDINS = HERE / "standins"
LOCATOR = HERE / "locate.py"  # locate_first.py, steps counted as the scripts count them
COUNTER = HERE / "count_steps.py"

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_SCRIPT = 0, 1, 2, 3

# ----------------------------------------------------------------------------- data sets

_WORDS = """
the of and to in a is that for it as was with be by on not he this are or his from at
which but have an they you were her she there been one all we their its has would more
if will about can other when who also time into only some could new them these two may
first then do any like my now over such our man me even most made after after said did
many before must through back years where much your way well down should because each
just those people how too little state good very make world still own see men work
long get here between both life being under never day same another know while last
might us great old year off come
""".split()  # noqa: SIM905 (a paragraph of words)


def _text(lines: int, seed: int) -> str:
    """Deterministic word salad with some structure (so a model learns something)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 14)
        start = rng.randrange(len(_WORDS))
        out.append(" ".join(_WORDS[(start + 3 * k + rng.randint(0, 1)) % len(_WORDS)]
                            for k in range(n)))
    return "\n".join(out) + "\n"


def prepare_nanogpt(work: Path) -> None:
    import pickle

    import numpy as np

    text = _text(400, 1)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    cut = int(len(ids) * 0.9)
    d = work / "data" / "tiny"
    d.mkdir(parents=True, exist_ok=True)
    ids[:cut].tofile(d / "train.bin")
    ids[cut:].tofile(d / "val.bin")
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)


def prepare_wlm(work: Path) -> None:
    d = work / "data" / "tiny"
    d.mkdir(parents=True, exist_ok=True)
    for name, lines, seed in (("train", 120, 2), ("valid", 24, 3), ("test", 24, 4)):
        (d / f"{name}.txt").write_text(_text(lines, seed), encoding="utf-8")


def prepare_none(work: Path) -> None:
    return None


def prepare_lightning(work: Path) -> None:
    """Lightning's own offline MNIST (``PL_USE_MOCKED_MNIST``) reads MNIST/complete/*.pt: the
    script splits 60000 training images 55000/5000, so the file has 60000 (synthetic)."""
    import torch

    d = work / "examples" / "Datasets" / "MNIST" / "complete"
    d.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("training.pt", 60000, 0), ("test.pt", 2000, 1)):
        g = torch.Generator().manual_seed(seed)
        targets = torch.randint(0, 10, (n,), generator=g)
        data = torch.randint(0, 64, (n, 28, 28), generator=g, dtype=torch.uint8)
        rows = torch.arange(n)
        data[rows, 4 + 2 * targets, 3:25] = 255  # class c: a bright bar at row 4 + 2c
        torch.save((data, targets), d / name)


def prepare_hf_clm(work: Path) -> None:
    """run_clm.py reads a text file and a tokenizer folder (``--tokenizer_name``): a word-level
    tokenizer over the word salad's words, built here with the ``tokenizers`` library."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = work / "data"
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.txt").write_text(_text(300, 5), encoding="utf-8")
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *sorted(set(_WORDS))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                   bos_token="<eos>", model_max_length=64)
    fast.save_pretrained(str(work / "tokenizer"))


def prepare_diffusers(work: Path) -> None:
    """train_unconditional.py reads an image folder (datasets' ``imagefolder``,
    ``--train_data_dir``) and a UNet config (``--model_config_name_or_path``): twelve 20x16
    RGB images (noise and a bright bar whose colour and place follow the index; the script
    resizes the shorter side to 16 and crops 16x16 at random) and a two-level UNet2DModel with
    one attention level."""
    import numpy as np
    from PIL import Image

    d = work / "data" / "train"
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for k in range(12):
        img = rng.integers(0, 60, (16, 20, 3), dtype=np.uint8)
        img[4:12, 3 + k % 9:9 + k % 9, k % 3] = 230
        Image.fromarray(img).save(d / f"{k:02d}.png")
    config = {"_class_name": "UNet2DModel", "sample_size": 16, "in_channels": 3,
              "out_channels": 3, "layers_per_block": 1, "block_out_channels": [16, 32],
              "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
              "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "norm_num_groups": 8,
              "attention_head_dim": 8}
    (work / "unet_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")


# ----------------------------------------------------------------------------- the corpus


@dataclasses.dataclass
class Entry:
    name: str
    upstream: str  # owner/name at commit (where the files come from)
    commit: str
    files: dict[str, str]  # path in sources/NAME -> sha256 of the unmodified upstream file
    script: str  # the script, relative to the entry's folder
    cwd: str  # where it runs, relative to the entry's folder
    healthy: list[str]
    failure: list[str]
    prepare: Callable[[Path], None] = prepare_none
    # ".", "standins" or "standins/NAME" (a folder of standins/), else relative to the copy
    pythonpath: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    outputs: list[str] = dataclasses.field(default_factory=list)  # globs, relative to cwd
    volatile: list[str] = dataclasses.field(default_factory=list)  # regexes masked in output
    # lines left out before comparing: progress bars, whose number of redraws follows the speed
    drop: list[str] = dataclasses.field(default_factory=list)
    target: str = "float16"  # the target nanhunt must pick
    fix: str = "lr-factor=0.001"  # the --fix tried on the failure
    fix_exit: int | None = None  # its expected exit code when the fix cannot act (2)
    style: str = ""
    fast: bool = False  # in the CI subset
    # the script's own options that add nanhunt's framework callback ({report}: its folder)
    callback: list[str] = dataclasses.field(default_factory=list)
    differ_with_callback: list[str] = dataclasses.field(default_factory=list)  # files it names
    # non-finite values the script makes on purpose (its README entry says which): locator
    # events matching every key of one of these are not the failure
    deliberate: list[dict[str, str]] = dataclasses.field(default_factory=list)
    # the sources/ folder, where the entry runs another entry's files (default: its name)
    sources: str = ""
    # a compiled run: the locator's TorchDispatchMode runs the model eagerly, whose numerics
    # differ (inductor fuses), so its event is no reference for the step; the plain run's own
    # printed losses are (``loss_line``: a regex of the step and its loss)
    loss_line: str = ""

    @property
    def folder(self) -> str:
        return self.sources or self.name


ENTRIES: list[Entry] = [
    Entry(
        name="nanogpt",
        upstream="karpathy/nanoGPT", commit="3adf61e154c3fe3fca428ad6bc3818b27a3b8291",
        files={
            "train.py": "413bd97b40bb400a2a0d01230e2946f056c263ebac1b7281c2367d964a123085",
            "model.py": "7c01703240dbec5d554527dc666e35b3df8391d0b117fddc07afcf325a21d11c",
            "configurator.py":
                "5cc23aca26b4ab3c0d9e5f82740f4781f9444f42718c15abcee70d93c5aabe8f",
            "LICENSE": "a59ec5cdb1c1e447e5266a014b3e7ded511f8d6e5a08931e931c87490ff821fe",
        },
        script="train.py", cwd=".", prepare=prepare_nanogpt,
        healthy=["--dataset=tiny", "--device=cpu", "--compile=False", "--dtype=float32",
                 "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32",
                 "--batch_size=4", "--gradient_accumulation_steps=2", "--max_iters=10",
                 "--eval_interval=5", "--eval_iters=2", "--warmup_iters=3",
                 "--lr_decay_iters=10", "--out_dir=out"],
        failure=["--learning_rate=1e20", "--grad_clip=0.0", "--weight_decay=0.0"],
        outputs=["out/*"],
        volatile=[r"time \d+\.\d+ms", r"mfu -?\d+\.\d+%"],
        style="GPT trainer: hand-written cosine lr schedule that sets absolute lr values "
              "each iteration, gradient accumulation, GradScaler (disabled), optional compile",
    ),
    Entry(
        name="word_language_model",
        upstream="pytorch/examples", commit="77f55b912142e11fcfdf5b530231fb9c52f181e8",
        files={
            "main.py": "391de12bb7c6e07dbb105d47d017632bf80c01d2e5b25adbf83da9cdcdd5a862",
            "model.py": "e4451a33e9b16953004bc639d736d14f42a2b21f2939ccabe4cff10d3c40b74c",
            "data.py": "15784815a6bd18e9b25eadf6ae049915f88d4fb8faebeba9d83ae6ec8e19883d",
            "LICENSE": "7e5dc9b5cf276166c4a0678d33e53b14e3d7ef47eee9356ab786c4ba45414efd",
        },
        script="main.py", cwd=".", prepare=prepare_wlm,
        healthy=["--data", "./data/tiny", "--model", "Transformer", "--emsize", "32",
                 "--nhid", "32", "--nlayers", "2", "--nhead", "2", "--bptt", "16",
                 "--batch_size", "8", "--epochs", "2", "--log-interval", "4",
                 "--dropout", "0.0", "--save", "model.pt"],
        failure=["--lr", "1e6", "--clip", "1e9"],
        outputs=["model.pt"],
        volatile=[r"ms/batch\s+\d+\.\d+", r"time:\s+\d+\.\d+s"],
        fix="clip=0.25", fix_exit=EXIT_USAGE,
        # the causal mask: log(tril(ones)), -inf above the diagonal, absorbed by the softmax
        deliberate=[{"op": "aten.log.default", "module": ""}],
        style="hand-written SGD (p.data.add_), no torch optimizer; torch.save(model) pickles "
              "the whole module",
    ),
    Entry(
        name="mingpt_adder",
        upstream="karpathy/minGPT", commit="37baab71b9abea1b76ab957409a1cc2fbfba8a26",
        files={
            "projects/adder/adder.py":
                "403acba17f6579fd09690ad2a353ca21287dbc2044f72d140a85c7dca82912e4",
            "mingpt/__init__.py":
                "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "mingpt/model.py": "3586d4a957722864f7a790689a094478d3ee0b7de34d7456cb635923e4779576",
            "mingpt/trainer.py":
                "7e28e58add6f998e7f2ccf3684a4a22a071ababd484a0f59030349dad4d36878",
            "mingpt/utils.py": "243dd4f91c68ea45421bcd4a82fa7fe9e0ee01bf90d52b5feefdb777db6e0568",
            "mingpt/bpe.py": "e480e8e0365b3f6d4bd92398af23ed2c5010c1eca3e685c0deecac4d8330de35",
            "LICENSE": "f372f582c99dc5b0e8dcf5ca5542183a735365468857ec6416af628490187cc1",
        },
        script="projects/adder/adder.py", cwd=".", pythonpath=["."],
        healthy=["--data.ndigit=1", "--trainer.max_iters=12", "--trainer.num_workers=2",
                 "--trainer.batch_size=16", "--trainer.device=cpu"],
        failure=["--trainer.learning_rate=1e6", "--trainer.grad_norm_clip=1e9"],
        outputs=["out/adder/*"],
        volatile=[r"iter_dt \d+\.\d+ms"],
        style="multi-worker DataLoader (2 workers, a sampler with replacement), callbacks, "
              "a Trainer class of its own",
    ),
    Entry(
        name="mnist",
        upstream="pytorch/examples", commit="77f55b912142e11fcfdf5b530231fb9c52f181e8",
        files={
            "main.py": "30a3359d1911d2d859dd090ce20be7ed132a33f508dc389f40366010b3e9ecc8",
            "LICENSE": "7e5dc9b5cf276166c4a0678d33e53b14e3d7ef47eee9356ab786c4ba45414efd",
        },
        script="main.py", cwd=".", pythonpath=["standins"],
        healthy=["--epochs", "2", "--batch-size", "32", "--test-batch-size", "64",
                 "--log-interval", "2", "--no-accel", "--save-model"],
        failure=["--lr", "1e30"],
        outputs=["mnist_cnn.pt"],
        fast=True,
        style="vision CNN trainer: Adadelta, StepLR, torchvision datasets/transforms (a "
              "stand-in: standins/torchvision)",
    ),
    Entry(
        name="lightning_classifier",
        upstream="Lightning-AI/pytorch-lightning",
        commit="7f0c3436cd3f6ad3753125672024fc415cbcb414",
        files={
            "examples/pytorch/basics/backbone_image_classifier.py":
                "a34c1eda8065de16185466d8abba545e770567a639c0f4e49b9f630523b2db1b",
            "LICENSE": "a41e2fae9915ae56028f8dbd0bf27995f1907613cbcd2d81a61b010ad34e9fe9",
        },
        script="examples/pytorch/basics/backbone_image_classifier.py", cwd=".",
        pythonpath=["standins"], env={"PL_USE_MOCKED_MNIST": "1"},
        prepare=prepare_lightning,
        healthy=["--trainer.max_epochs=1", "--trainer.limit_train_batches=8",
                 "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2",
                 "--trainer.limit_predict_batches=1", "--trainer.accelerator=cpu",
                 "--trainer.precision=bf16-mixed", "--trainer.enable_progress_bar=false",
                 "--trainer.enable_model_summary=false", "--data.batch_size=16"],
        failure=["--model.learning_rate=1e30"],
        outputs=["lightning_logs/**"],
        volatile=[r"\d+\.\d+s", r"v_num=\d+"],
        target="bfloat16",
        callback=["--trainer.callbacks+=nanhunt.integrations.lightning.NanhuntCallback",
                  "--trainer.callbacks.out={report}", "--trainer.callbacks.keep_going=true"],
        differ_with_callback=["lightning_logs/version_0/config.yaml"],
        style="Lightning: LightningCLI flags, bf16-mixed autocast, Adam, checkpoint, test and "
              "predict from the best checkpoint",
    ),
    Entry(
        name="hf_run_clm",
        upstream="huggingface/transformers", commit="00d481d18f914b55e65faa31e82321629691eadb",
        files={
            "examples/pytorch/language-modeling/run_clm.py":
                "1031342ea9c5cf11710b669a2aea574154821f9c323184c9c9d38bfca58aac7e",
            # the Apache-2.0 text as transformers 5.24.0's source distribution ships it
            "LICENSE": "77fd4710def9ec3c0f6225800e0235f15a425abd4a8b03559127fcd782612049",
        },
        script="examples/pytorch/language-modeling/run_clm.py", cwd=".",
        prepare=prepare_hf_clm,
        healthy=["--model_type", "gpt2", "--tokenizer_name", "./tokenizer",
                 "--config_overrides", "n_embd=32,n_layer=2,n_head=2,n_positions=64,"
                 "vocab_size=134,bos_token_id=1,eos_token_id=1",
                 "--train_file", "data/train.txt", "--cache_dir", "./cache", "--do_train",
                 "--block_size", "32", "--per_device_train_batch_size", "4",
                 "--max_steps", "8", "--bf16", "--use_cpu", "--output_dir", "out",
                 "--report_to", "none", "--logging_steps", "2", "--save_strategy", "no",
                 "--seed", "0", "--disable_tqdm", "true"],
        failure=["--learning_rate", "1e20", "--max_grad_norm", "0"],
        outputs=["out/model.safetensors", "out/config.json", "out/generation_config.json",
                 "out/tokenizer*.json", "out/training_args.bin", "out/README.md"],
        volatile=[r"\d\d/\d\d/\d{4} \d\d:\d\d:\d\d", r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+",
                  r"default-[0-9a-f]{16}", r"cache-[0-9a-f]{16}",
                  r"(runtime|per_second)('?:? *=? *'?)[\d:.]+"],
        drop=[r"(examples/s|it/s|s/it)\]", r"^\s*$"],
        target="bfloat16",
        style="Hugging Face Trainer (transformers 5): HfArgumentParser flags, datasets' text "
              "loader and map cache, GPT-2 from a config, accelerate's bf16 autocast on CPU "
              "(--bf16 --use_cpu), gradient clipping, safetensors checkpoint",
    ),
    Entry(
        name="diffusers_unconditional",
        upstream="huggingface/diffusers", commit="d035dcd7cc7c88e0a154609b62887d50bba9fdc2",
        files={
            "examples/unconditional_image_generation/train_unconditional.py":
                "2bff18c8fe73d92037ae27a5e0f42575d60c75edbd4eb84a13ee1e7795613f2e",
            "LICENSE": "f9e2070c247517b1ddf65f7b11b393484a18da91a958fd18a97bd0f241c3125c",
        },
        script="examples/unconditional_image_generation/train_unconditional.py", cwd=".",
        # the script never seeds: standins/seed seeds torch, numpy and random at start-up
        pythonpath=["standins", "standins/seed"], prepare=prepare_diffusers,
        healthy=["--train_data_dir", "data/train", "--model_config_name_or_path",
                 "unet_config.json", "--resolution", "16", "--train_batch_size", "4",
                 "--eval_batch_size", "2", "--num_epochs", "2", "--save_images_epochs", "1",
                 "--save_model_epochs", "1", "--lr_warmup_steps", "2", "--ddpm_num_steps", "50",
                 "--ddpm_num_inference_steps", "4", "--checkpointing_steps", "4", "--use_ema",
                 "--mixed_precision", "bf16", "--output_dir", "out", "--cache_dir", "./cache"],
        failure=["--learning_rate", "1e20"],
        outputs=["out/**"],
        # logging's timestamps; tqdm's bars (the epochs', the sampling pipeline's, datasets'),
        # masked where a log record follows a bar on its line, then left out (their redraws
        # follow the machine's speed), with the blank lines they leave
        volatile=[r"\d\d/\d\d/\d{4} \d\d:\d\d:\d\d",
                  r"(Epoch \d+: *)?\d+%\|[^|\r\n]*\|[^\]\r\n]*\]",
                  r"Generating train split: \d+ examples \[[^\]\r\n]*\]"],
        drop=[r"^(<v>|\s)*$"],
        target="bfloat16",
        style="diffusers: accelerate (bf16 autocast on CPU), UNet2DModel from a config, "
              "DDPMScheduler noise, AdamW with a warmup-cosine schedule and a fixed clip, EMA, "
              "accelerate's save_state checkpoint, DDPMPipeline sampling, TensorBoard",
    ),
]

# nanoGPT with its default torch.compile on (inductor on CPU: gcc builds the kernels; the first
# process fills inductor's cache, the others reuse it), from the same files
_NANOGPT = ENTRIES[0]
ENTRIES.insert(1, dataclasses.replace(
    _NANOGPT, name="nanogpt_compile", sources=_NANOGPT.name,
    healthy=[a if a != "--compile=False" else "--compile=True" for a in _NANOGPT.healthy],
    loss_line=r"^iter (\d+): loss (\S+),",
    style="nanoGPT with its default torch.compile (inductor on CPU)"))


# ----------------------------------------------------------------------------- running


@dataclasses.dataclass
class RunResult:
    rc: int
    stdout: str
    stderr: str
    seconds: float
    work: Path
    report: dict | None = None


def verify_sources(entry: Entry) -> str | None:
    """None when every file is present and unmodified, else why not."""
    base = SOURCES / entry.folder
    for rel, digest in entry.files.items():
        path = base / rel
        if not path.is_file():
            return f"missing sources/{entry.folder}/{rel}"
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return f"{rel} differs from {entry.upstream}@{entry.commit[:10]}"
    return None


def materialise(entry: Entry, work: Path) -> None:
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(SOURCES / entry.folder, work)
    entry.prepare(work)


def _env(entry: Entry, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(work if p == "." else STANDINS if p == "standins"
                 else STANDINS / p.split("/", 1)[1] if p.startswith("standins/") else work / p)
             for p in entry.pythonpath]
    paths += [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", PYTHONHASHSEED="0",
               WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", NO_COLOR="1", COLUMNS="100")
    env.pop("NANHUNT_RERUN", None)
    env.update(entry.env)
    return env


def run(entry: Entry, work: Path, prefix: list[str], args: list[str], timeout: float,
        extra_env: dict[str, str] | None = None) -> RunResult:
    materialise(entry, work)
    env = _env(entry, work)
    env.update(extra_env or {})
    cmd = [sys.executable, *prefix, str(work / entry.script), *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=work / entry.cwd, env=env, capture_output=True, text=True,
                           timeout=timeout, errors="replace", stdin=subprocess.DEVNULL)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = -9, _s(exc.stdout), _s(exc.stderr) + f"\n[timed out after {timeout}s]"
    res = RunResult(rc, out, err, time.monotonic() - t0, work)
    for name, text in (("stdout", out), ("stderr", err)):  # kept beside the scratch copy
        (work.parent / f"{work.name}.{name}").write_text(text, encoding="utf-8")
    report = work.parent / (work.name + "-report") / "report.json"
    if report.is_file():
        res.report = json.loads(report.read_text(encoding="utf-8"))
    return res


def _s(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def nanhunt(command: str, work: Path, options: list[str]) -> list[str]:
    out = work.parent / (work.name + "-report")
    if out.exists():
        shutil.rmtree(out)
    return ["-m", "nanhunt", command, "--quiet", "--out", str(out), *options]


# ----------------------------------------------------------------------------- checks


@dataclasses.dataclass
class Check:
    entry: str
    variant: str
    mode: str
    check: str
    ok: bool
    detail: str = ""


def _normalise(text: str, entry: Entry, work: Path) -> list[str]:
    text = text.replace(str(work), "<work>")
    for pattern in entry.volatile:
        text = re.sub(pattern, "<v>", text)
    return [ln for ln in text.splitlines()
            if not any(re.search(pattern, ln) for pattern in entry.drop)]


def _own(lines: list[str]) -> list[str]:
    # nanhunt's own lines (its notes on stderr) are not the script's
    return [ln for ln in lines if not ln.startswith("nanhunt")]


def _without_tail(lines: list[str], plain: list[str]) -> list[str]:
    """The lines before a block nanhunt printed after the script's whole output (a callback's
    summary at the process's end), which begins with a line that starts with 'nanhunt'."""
    for k, ln in enumerate(lines):
        if ln.startswith("nanhunt") and _own(lines[:k]) == plain:
            return lines[:k]
    return lines


def same_output(entry: Entry, ref: RunResult, got: RunResult, *, prefix: bool) -> str | None:
    for stream in ("stdout", "stderr"):
        a = _own(_normalise(getattr(ref, stream), entry, ref.work))
        raw = _normalise(getattr(got, stream), entry, got.work)
        b = _own(_without_tail(raw, a) if stream == "stderr" else raw)
        if prefix:
            a = a[:len(b)]
        if a != b:
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"{stream} differs at line {i + 1}: plain {a[i] if i < len(a) else '<end>'!r}"
                    f" / nanhunt {b[i] if i < len(b) else '<end>'!r}")
    return None


def _files(entry: Entry, work: Path) -> dict[str, Path]:
    base = work / entry.cwd
    found: dict[str, Path] = {}
    for path in sorted(base.rglob("*")):
        rel = path.relative_to(base).as_posix()
        if path.is_file() and any(fnmatch.fnmatch(rel, g) for g in entry.outputs):
            found[rel] = path
    return found


def _same_file(a: Path, b: Path, works: tuple[Path, Path] | None = None) -> str | None:
    x, y = a.read_bytes(), b.read_bytes()
    if x == y:
        return None
    if works is not None and x.replace(str(works[0]).encode(), b"<work>") == \
            y.replace(str(works[1]).encode(), b"<work>"):
        return None  # the same text, naming each run's own scratch copy (minGPT's args.txt)
    if a.suffix in (".pt", ".ckpt", ".pth"):
        import torch

        x = torch.load(a, map_location="cpu", weights_only=False)
        y = torch.load(b, map_location="cpu", weights_only=False)
        diff = _tensor_diff(x, y, "")
        return None if diff is None else f"{a.name}: {diff}"
    return f"{a.name}: bytes differ"


def _tensor_diff(x: Any, y: Any, where: str) -> str | None:
    import torch

    if isinstance(x, torch.nn.Module):
        x, y = x.state_dict(), y.state_dict() if isinstance(y, torch.nn.Module) else y
    if isinstance(x, torch.Tensor):
        if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape:
            return f"{where}: tensor type/shape"
        return None if torch.equal(x.view(-1).view(torch.uint8) if x.is_floating_point()
                                   else x, y.view(-1).view(torch.uint8)
                                   if y.is_floating_point() else y) else f"{where}: values"
    if isinstance(x, dict):
        if not isinstance(y, dict) or set(x) != set(y):
            return f"{where}: keys"
        for k in x:
            d = _tensor_diff(x[k], y[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(x, (list, tuple)):
        if not isinstance(y, (list, tuple)) or len(x) != len(y):
            return f"{where}: length"
        for i, (a, b) in enumerate(zip(x, y)):
            d = _tensor_diff(a, b, f"{where}[{i}]")
            if d:
                return d
        return None
    return None


def same_files(entry: Entry, ref: RunResult, got: RunResult, *, subset: bool,
               ignore: tuple[str, ...] = ()) -> str | None:
    a, b = _files(entry, ref.work), _files(entry, got.work)
    for rel in ignore:
        a.pop(rel, None)
        b.pop(rel, None)
    # TensorBoard event files are named and stamped with the time and the process id: two
    # plain runs differ too
    for files in (a, b):
        for rel in [r for r in files if "events.out.tfevents." in r]:
            files.pop(rel)
    if not subset and set(a) != set(b):
        return f"files differ: only plain {sorted(set(a) - set(b))}, only nanhunt " \
               f"{sorted(set(b) - set(a))}"
    if set(b) - set(a):
        return f"files only under nanhunt: {sorted(set(b) - set(a))}"
    for rel in b if subset else a:
        try:
            d = _same_file(a[rel], b[rel], (ref.work, got.work))
        except Exception as exc:  # an unreadable checkpoint is a difference
            d = f"{rel}: {type(exc).__name__}: {exc}"
        if d:
            return d
    return None


def count_steps(entry: Entry, work: Path, args: list[str], timeout: float) -> dict | None:
    out = work.parent / (work.name + "-counts.json")
    if out.exists():
        out.unlink()
    run(entry, work, [str(COUNTER)], args, timeout, {"COUNT_STEPS_OUT": str(out)})
    return json.loads(out.read_text()) if out.is_file() else None


_EVENT = re.compile(r"^NONFINITE (\{.*\})$")


def locate(entry: Entry, work: Path, args: list[str], timeout: float) -> dict | None:
    import ast

    res = run(entry, work, [str(LOCATOR), "--max-events", str(1 + 2 * len(entry.deliberate))],
              args, timeout)
    for line in res.stdout.splitlines():
        m = _EVENT.match(line.strip())
        if m:
            event = ast.literal_eval(m.group(1))
            if not any(all(str(event.get(k)) == v for k, v in d.items())
                       for d in entry.deliberate):
                return event
    return None


# ----------------------------------------------------------------------------- one entry


MODES = ("full", "keepgoing", "sentinel", "sample", "audit", "callback", "fix", "verify")
# the CI subset: the fast entries' failure variant in full and sentinel mode (4 runs each)
FAST_MODES = ("full", "sentinel")
FAST_VARIANTS = ("failure",)


def check_entry(entry: Entry, modes: tuple[str, ...], root: Path, timeout: float,
                log: Callable[[str], None],
                variants: tuple[str, ...] = ("healthy", "failure")) -> list[Check]:
    checks: list[Check] = []

    def add(variant: str, mode: str, name: str, problem: str | None) -> None:
        checks.append(Check(entry.name, variant, mode, name, problem is None, problem or ""))
        if problem:
            log(f"    FAIL {variant}/{mode}/{name}: {problem}")

    base = root / entry.name
    for variant in variants:
        args = entry.healthy + (entry.failure if variant == "failure" else [])
        vdir = base / variant
        plain = run(entry, vdir / "plain", [], args, timeout)
        log(f"  {entry.name}/{variant}: plain rc={plain.rc} ({plain.seconds:.1f}s)")
        add(variant, "plain", "plain run ends", None if plain.rc == 0 else
            f"plain python exited {plain.rc}: {plain.stderr.strip().splitlines()[-1:]}")
        counts = count_steps(entry, vdir / "count", args, timeout) if variant == "healthy" \
            else None
        located = locate(entry, vdir / "locate", args, timeout) if variant == "failure" \
            else None
        if variant == "failure":
            add(variant, "locator", "the failure reproduces", None if located else
                "the independent locator saw no non-finite value")
        for mode in modes:
            if mode == "audit" and variant == "failure":
                continue
            if mode in ("keepgoing", "fix", "verify") and variant == "healthy":
                continue
            work = vdir / mode
            if mode == "callback":
                if not entry.callback:
                    continue
                report = work.parent / (work.name + "-report")
                shutil.rmtree(report, ignore_errors=True)
                res = run(entry, work, [], args + [a.format(report=report)
                                                   for a in entry.callback], timeout)
                log(f"  {entry.name}/{variant}/{mode}: rc={res.rc} ({res.seconds:.1f}s)")
                checks.extend(_judge(entry, variant, mode, plain, res, counts, located, add))
                continue
            opts = {"full": ["--verify", "0"], "keepgoing": ["--verify", "0", "--keep-going"],
                    "sentinel": ["--mode", "sentinel", "--verify", "0"],
                    "sample": ["--sample-every", "3", "--verify", "0"],
                    "fix": ["--fix", entry.fix, "--verify", "0"],
                    "verify": ["--verify", "2", "--jobs", "1"], "audit": []}[mode]
            res = run(entry, work, nanhunt("audit" if mode == "audit" else "diagnose", work,
                                           opts), args, timeout)
            log(f"  {entry.name}/{variant}/{mode}: rc={res.rc} ({res.seconds:.1f}s)")
            checks.extend(_judge(entry, variant, mode, plain, res, counts, located, add))
    return checks


def _consistent_with_losses(entry: Entry, plain: RunResult, ff: dict) -> str | None:
    """Whether nanhunt's first failure agrees with the plain run's printed losses: a forward
    failure at the first step whose loss printed non-finite, a backward, optimizer or later
    failure at the step before it (that step's loss printed finite)."""
    losses = {}
    for line in plain.stdout.splitlines():
        m = re.match(entry.loss_line, line.strip())
        if m:
            losses.setdefault(int(m.group(1)), float(m.group(2)))
    bad = min((k for k, v in losses.items() if not math.isfinite(v)), default=None)
    if bad is None:
        return "the plain run printed no non-finite loss"
    want = (bad, ("forward",)) if ff.get("phase") == "forward" else (
        bad - 1, ("backward", "optimizer", "communication", "loss_scaling"))
    if ff.get("step") != want[0] or ff.get("phase") not in want[1]:
        return (f"step {ff.get('step')} {ff.get('phase')}: the plain run printed its first "
                f"non-finite loss at step {bad}")
    return None


def _judge(entry: Entry, variant: str, mode: str, plain: RunResult, res: RunResult,
           counts: dict | None, located: dict | None, add: Callable) -> list[Check]:
    rep = res.report or {}
    runinfo = rep.get("run", {})
    if mode == "fix" and entry.fix_exit is not None:
        # the script's own stderr (its warnings before its first step) is not nanhunt's
        own = set(plain.stderr.splitlines())
        lines = [ln for ln in res.stderr.splitlines() if ln.strip() and ln not in own]
        ok = res.rc == entry.fix_exit and len(lines) == 1 and lines[0].startswith("nanhunt:")
        add(variant, mode, "a fix that cannot act is refused",
            None if ok else f"rc {res.rc}, stderr {lines[-3:]}")
        return []
    # exit code
    want = {"healthy": EXIT_OK, "failure": EXIT_PROBLEM}[variant]
    if mode == "callback":
        want = plain.rc  # the script's own run: a callback does not change its exit status
    if mode == "fix":
        ok = res.rc in (EXIT_OK, EXIT_PROBLEM)
        add(variant, mode, "exit code", None if ok else f"rc {res.rc}: "
            f"{res.stderr.strip().splitlines()[-1:]}")
    else:
        add(variant, mode, "exit code", None if res.rc == want else
            f"rc {res.rc}, expected {want}: {res.stderr.strip().splitlines()[-2:]}")
    # transparency
    stopped = runinfo.get("status") == "stopped"
    if mode != "fix":
        add(variant, mode, "stdout/stderr as plain",
            same_output(entry, plain, res, prefix=stopped))
    if mode not in ("fix",):
        add(variant, mode, "outputs bit-identical",
            same_files(entry, plain, res, subset=stopped or (variant == "failure"
                       and mode not in ("keepgoing", "callback")),
                       ignore=tuple(entry.differ_with_callback) if mode == "callback" else ()))
    if mode == "audit":
        return []
    if not rep:
        add(variant, mode, "report written", "no report.json")
        return []
    # target format
    add(variant, mode, "target format", None if runinfo.get("target") == entry.target else
        f"target {runinfo.get('target')} ({runinfo.get('target_source')}), expected "
        f"{entry.target}")
    if variant == "healthy" and counts is not None and mode in ("full", "sentinel", "sample",
                                                                 "callback"):
        want_steps = counts["scaler_updates"] or counts["optimizer_steps"] \
            or counts["backward_calls"]
        got = len(rep.get("steps") or [])
        got = max(got, 1 + max((s.get("index", -1) for s in rep.get("steps") or []),
                               default=-1))
        add(variant, mode, "step count", None if got == want_steps else
            f"{got} steps reported, {want_steps} counted ({counts})")
    if variant == "failure" and mode in ("full", "sentinel", "sample", "keepgoing", "callback"):
        ff = rep.get("first_failure")
        if located is None:
            add(variant, mode, "failure located", "no reference event")
        elif not ff:
            add(variant, mode, "failure located", "no first_failure in the report")
        elif entry.loss_line:
            add(variant, mode, "failure located", _consistent_with_losses(entry, plain, ff))
        elif mode == "sample" and not ff.get("module") and \
                not (rep.get("diagnosis") or {}).get("kind"):
            # documented: a failure on a step that was not traced names no cause
            add(variant, mode, "failure located", None)
        else:
            want_module = located.get("module") or ""
            diffs = []
            if ff.get("step") != located.get("step"):
                diffs.append(f"step {ff.get('step')} vs {located.get('step')}")
            if ff.get("phase") != located.get("phase"):
                diffs.append(f"phase {ff.get('phase')} vs {located.get('phase')}")
            if ff.get("module") != want_module:
                diffs.append(f"module {ff.get('module')!r} vs {want_module!r}")
            add(variant, mode, "failure located", "; ".join(diffs) or None)
        diag = rep.get("diagnosis") or {}
        if mode != "sample" or diag.get("kind"):
            add(variant, mode, "cause named", None if diag.get("kind") else
                "no diagnosis kind")
    if mode == "verify":
        for rec in rep.get("recommendations") or []:
            for t in rec.get("tries") or []:
                reason = t.get("reason") or ""
                if "crash" in reason or "raised" in reason or "Error" in reason:
                    add(variant, mode, "re-runs do not crash", f"{t.get('fixes')}: {reason}")
                    return []
        add(variant, mode, "re-runs do not crash", None)
    return []


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="entries to run")
    ap.add_argument("--modes", nargs="*", default=None, choices=MODES)
    ap.add_argument("--fast", action="store_true", help="the CI subset")
    ap.add_argument("--variants", nargs="*", default=None, choices=("healthy", "failure"))
    ap.add_argument("--json", default=None, help="write the checks here")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    ap.add_argument("--jobs", type=int, default=1,
                    help="entries' variants run at once (each run is one process of one torch "
                         "thread; default 1)")
    opts = ap.parse_args(argv)
    import tempfile

    root = Path(opts.work) if opts.work else Path(tempfile.mkdtemp(prefix="realworld-"))
    entries = [e for e in ENTRIES if (opts.only is None or e.name in opts.only)
               and (not opts.fast or e.fast)]
    modes = tuple(opts.modes or (FAST_MODES if opts.fast else MODES))
    checks: list[Check] = []
    skipped: dict[str, str] = {}
    t0 = time.monotonic()
    variants = tuple(opts.variants or (FAST_VARIANTS if opts.fast else ("healthy", "failure")))
    units = []
    for entry in entries:
        why = verify_sources(entry)
        if why:
            skipped[entry.name] = why
            print(f"{entry.name}: not run ({why}; see benchmarks/realworld/README.md)")
            continue
        print(f"{entry.name} ({entry.upstream}@{entry.commit[:10]})", flush=True)
        units += [(entry, v) for v in variants]
    # each (entry, variant) in its own folder: independent, so they can run side by side
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, opts.jobs)) as pool:
        for got in pool.map(lambda u: check_entry(u[0], modes, root, opts.timeout,
                                                  lambda s: print(s, flush=True), (u[1],)),
                            units):
            checks += got
    seconds = time.monotonic() - t0
    held = sum(c.ok for c in checks)
    print(f"\n{held} of {len(checks)} checks hold ({len(entries) - len(skipped)} scripts, "
          f"{seconds:.0f}s)")
    for c in checks:
        if not c.ok:
            print(f"  {c.entry}/{c.variant}/{c.mode}: {c.check}: {c.detail}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({
            "checks": [dataclasses.asdict(c) for c in checks], "skipped": skipped,
            "seconds": round(seconds, 1), "held": held, "total": len(checks)}, indent=1))
    if not opts.work:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if held == len(checks) and not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
