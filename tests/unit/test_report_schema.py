"""docs/report-schema.md documents every JSON field, and its example is a loadable report."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from nanhunt.trace import (
    SCHEMA_VERSION,
    CastCounts,
    Experiment,
    Experiments,
    Failure,
    Finding,
    FixTry,
    LayerStats,
    LayerStep,
    OpRecord,
    PrecisionAudit,
    PrecisionLayer,
    PrecisionLoss,
    RankSummary,
    Recommendation,
    RunInfo,
    ScalerEvent,
    StepRecord,
    TensorStats,
    Trace,
    Verification,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "report-schema.md"
SECTIONS = {
    Trace: "Trace (top level)",
    RunInfo: "RunInfo",
    StepRecord: "StepRecord",
    ScalerEvent: "ScalerEvent",
    LayerStats: "LayerStats",
    CastCounts: "CastCounts",
    LayerStep: "LayerStep",
    TensorStats: "TensorStats",
    Failure: "Failure",
    Finding: "Finding",
    Recommendation: "Recommendation",
    OpRecord: "OpRecord",
    RankSummary: "RankSummary",
    PrecisionAudit: "PrecisionAudit",
    PrecisionLayer: "PrecisionLayer",
    PrecisionLoss: "PrecisionLoss",
    FixTry: "FixTry",
    Verification: "Verification",
    Experiments: "Experiments",
    Experiment: "Experiment",
}


def section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no section '## {title}'"
    return match.group(1)


@pytest.mark.parametrize("cls", list(SECTIONS), ids=lambda c: c.__name__)
def test_every_field_is_documented_in_order(cls):
    body = section(DOC.read_text(encoding="utf-8"), SECTIONS[cls])
    documented = re.findall(r"^\| `(\w+)` \|", body, re.M)
    assert documented == [f.name for f in dataclasses.fields(cls)]


def test_example_is_a_loadable_report():
    text = DOC.read_text(encoding="utf-8")
    (block,) = re.findall(r"```json\n(.*?)```", text, re.S)
    data = json.loads(block)
    assert data["schema_version"] == SCHEMA_VERSION
    assert list(data) == [f.name for f in dataclasses.fields(Trace)]
    trace = Trace.from_dict(data)
    assert trace.first_failure is not None
    assert trace.first_failure.stats.headroom == float("-inf")
    assert f"schema version **{SCHEMA_VERSION}**" in text
