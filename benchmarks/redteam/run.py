#!/usr/bin/env python
"""Hold-out evaluation of nanhunt against the red-team scripts.

    python run.py [NANHUNT_SRC] [--set DIR] [--only GLOB] [--jobs N] [--timeout S] [--results FILE]
        [--verify N]

--set DIR picks the hold-out set: DIR/expected.json and DIR/scripts/ (default: this folder, the
first red-team set; benchmarks/redteam2 is the second). Runs
`python -m nanhunt diagnose --quiet --verify 0 --out <tmp> scripts/<script>` (``--verify N``
with the option) for every script in
expected.json with PYTHONPATH=NANHUNT_SRC (default: this checkout) and OMP_NUM_THREADS=1, reads
<tmp>/report.json and compares it with expected.json:

  exit    the exit code must equal expected.exit
  phase   got = first_failure.phase, or diagnosis.phase when there is no first_failure
  kind    got = diagnosis.kind (null when there is no diagnosis)
  module  got = first_failure.module, or diagnosis.module when there is no first_failure;
          expected "" matches ""/null ("no module owns it")
  source_contains (where given) must occur in first_failure.source_line/source or in the
          diagnosis message/evidence
Expected null = not checked; a list = any of these. A script PASSes when every checked field
matches. For exit-0 scripts only the exit code counts. The recommendation types (`fix`) and the
step are reported as secondary columns and do not affect PASS.
Results go to DIR/results/<label>.json (label = basename of NANHUNT_SRC) unless --results is
given; each script's report folder is kept under DIR/results/reports/<label>/<script>/.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import fnmatch
import json
import os
import subprocess
import sys
import shutil
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))


def as_list(v):
    return v if isinstance(v, list) else [v]


def match(expected, got, field):
    if expected is None:
        return True
    for e in as_list(expected):
        if field == "module" and e == "" and got in ("", None):
            return True
        if e == got:
            return True
    return False


def run_one(script, exp, src, timeout, reports, set_dir=HERE, verify=0):
    out = os.path.join(reports, os.path.splitext(script)[0])
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "nanhunt", "diagnose", "--quiet", "--verify", str(verify), "--out", out,
           os.path.join(set_dir, "scripts", script)]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=timeout)
        rc, stderr = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, stderr = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(
            e.stderr, bytes) else (e.stderr or "")
    wall = time.time() - t0
    got = dict(exit=rc, phase=None, kind=None, module=None, step=None, op=None, source_line=None,
               rule=None, recs=[], message=None, report=False)
    rp = os.path.join(out, "report.json")
    text_blob = ""
    if os.path.exists(rp):
        try:
            r = json.load(open(rp))
            got["report"] = True
            ff, dg = r.get("first_failure"), r.get("diagnosis")
            if ff:
                got.update(phase=ff.get("phase"), module=ff.get("module"), step=ff.get("step"),
                           op=ff.get("op"), source_line=ff.get("source_line"))
                text_blob += " ".join(str(ff.get(k) or "") for k in ("source_line", "source", "detail"))
            if dg:
                got["kind"] = dg.get("kind")
                got["rule"] = dg.get("rule")
                got["message"] = dg.get("message")
                if not ff:
                    got.update(phase=dg.get("phase"), module=dg.get("module"), step=dg.get("step"))
                text_blob += " " + (dg.get("message") or "") + " " + " ".join(dg.get("evidence") or [])
            got["recs"] = [(x.get("type"), bool(x.get("verified"))) for x in r.get("recommendations", [])]
            ex = r.get("experiments") or {}
            got["verdict"] = ex.get("verdict")  # with --verify N: the experiments' verdict
            got["verified_fix"] = next((x.get("fix") for x in r.get("recommendations", [])
                                        if x.get("verified")), None)
        except Exception as e:  # noqa: BLE001
            got["report_error"] = repr(e)
    checks = {"exit": got["exit"] == exp["exit"]}
    if exp["exit"] != 0:
        checks["phase"] = match(exp.get("phase"), got["phase"], "phase")
        checks["kind"] = match(exp.get("kind"), got["kind"], "kind")
        checks["module"] = match(exp.get("module"), got["module"], "module")
        if exp.get("source_contains"):
            checks["source"] = exp["source_contains"] in text_blob
    ok = all(checks.values())
    fix_ok = None
    if exp.get("fix"):
        fix_ok = any(t in exp["fix"] for t, _ in got["recs"])
    step_ok = None if exp.get("step") is None or exp["exit"] == 0 else got["step"] == exp["step"]
    return dict(script=script, expected=exp, got=got, checks=checks, pass_=ok, fix_ok=fix_ok,
                step_ok=step_ok, wall_s=round(wall, 1), stderr_tail=stderr[-1500:])


def fmt(v):
    if isinstance(v, list):
        return "|".join("''" if x == "" else str(x) for x in v)
    return "-" if v is None else ("''" if v == "" else str(v))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src", nargs="?", default=str(Path(__file__).resolve().parents[2]))
    ap.add_argument("--set", dest="set_dir", default=HERE,
                    help="hold-out set folder with expected.json and scripts/ (default: this one)")
    ap.add_argument("--only", default="*")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--results")
    ap.add_argument("--verify", type=int, default=0,
                    help="nanhunt diagnose --verify N (default 0: the rules' verdict alone, as "
                         "the recorded scores; with N the report's experiments verdict and "
                         "verified fix are recorded too)")
    a = ap.parse_args()
    set_dir = os.path.abspath(a.set_dir)
    if not os.path.isfile(os.path.join(set_dir, "expected.json")):
        sys.exit(f"run.py: no expected.json in {set_dir}")
    expected = json.load(open(os.path.join(set_dir, "expected.json")))
    scripts = [s for s in expected if fnmatch.fnmatch(s, a.only)]
    label = os.path.basename(os.path.normpath(a.src))
    reports = os.path.join(set_dir, "results", "reports", label)
    with cf.ThreadPoolExecutor(a.jobs) as ex:
        res = list(ex.map(lambda s: run_one(s, expected[s], a.src, a.timeout, reports, set_dir, a.verify),
                          scripts))
    rows = []
    hdr = ("script", "exp exit/phase/kind/module", "got exit/phase/kind/module", "result", "fix", "step")
    for r in res:
        e, g = r["expected"], r["got"]
        exp_s = f"{e['exit']} {fmt(e.get('phase'))} {fmt(e.get('kind'))} {fmt(e.get('module'))}" \
            if e["exit"] else "0"
        got_s = f"{g['exit']} {fmt(g['phase'])} {fmt(g['kind'])} {fmt(g['module'])}"
        bad = [k for k, v in r["checks"].items() if not v]
        res_s = "PASS" if r["pass_"] else "FAIL(" + ",".join(bad) + ")"
        fix_s = "-" if r["fix_ok"] is None else ("ok" if r["fix_ok"] else "no")
        step_s = "-" if r["step_ok"] is None else ("ok" if r["step_ok"] else f"{g['step']}≠{e['step']}")
        rows.append((r["script"], exp_s, got_s, res_s, fix_s, step_s))
    w = [max(len(str(x[i])) for x in rows + [hdr]) for i in range(len(hdr))]
    line = lambda x: "  ".join(str(c).ljust(w[i]) for i, c in enumerate(x))  # noqa: E731
    print(line(hdr))
    print("  ".join("-" * n for n in w))
    for x in rows:
        print(line(x))
    n = len(res)
    n_pass = sum(r["pass_"] for r in res)
    fail_h = [r["script"] for r in res if r["expected"]["exit"] == 0 and not r["pass_"]]
    fails = [r for r in res if r["expected"]["exit"] != 0]
    by = {k: sum(1 for r in fails if r["checks"].get(k)) for k in ("exit", "phase", "kind", "module")}
    fixes = [r["fix_ok"] for r in res if r["fix_ok"] is not None]
    print(f"\nPASS {n_pass}/{n}  (failing scripts: {sum(r['pass_'] for r in fails)}/{len(fails)}; "
          f"healthy: {sum(r['pass_'] for r in res if r['expected']['exit'] == 0)}/{n - len(fails)})")
    print("field accuracy on failing scripts: " + ", ".join(f"{k} {v}/{len(fails)}" for k, v in by.items()))
    print(f"a recommendation of an expected type: {sum(fixes)}/{len(fixes)}")
    if fail_h:
        print("healthy scripts flagged:", ", ".join(fail_h))
    classes = {}
    for r in res:  # optional "class" field (the second set has one); the first set has none
        if r["expected"].get("class"):
            classes.setdefault(r["expected"]["class"], []).append(r["pass_"])
    if classes:
        print("per class: " + ", ".join(f"{c} {sum(v)}/{len(v)}" for c, v in classes.items()))
    path = a.results or os.path.join(set_dir, "results", f"{label}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        commit = subprocess.run(["git", "-C", a.src, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    print("nanhunt:", a.src, commit)
    json.dump(dict(src=a.src, set=set_dir, commit=commit, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   passed=n_pass, total=n, results=res), open(path, "w"), indent=1, default=str)
    print("results:", path)


if __name__ == "__main__":
    main()
