"""Run the reliability suite and write `results/reliability.md`.

    python -m tests.reliability.report            # the slow suite: 10 kill points (make reliability)
    python -m tests.reliability.report --ci       # CI's subset: 3 kill points
    python -m tests.reliability.report -- -x      # options after -- go to pytest

The tests append what they established (kills survived, bitwise comparisons, bad-input cases with
their error line, security scans) to a records file; pytest's JUnit XML gives each test's outcome.
Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

from data.config import REPO_ROOT

OUTPUT = REPO_ROOT / "results" / "reliability.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="CI's 3 kill points instead of the slow suite's 10")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="reliability-") as folder:
        work = Path(folder)
        records, junit, basetemp = work / "records.jsonl", work / "junit.xml", work / "pytest"
        env = {**os.environ, "RELIABILITY_RECORD": str(records), "RELIABILITY_FULL": "0" if args.ci else "1"}
        command = [sys.executable, "-m", "pytest", "tests/reliability", "-p", "no:cacheprovider", "-q"]
        command += [f"--junitxml={junit}", f"--basetemp={basetemp}", *args.pytest_args]
        started = time.monotonic()
        returncode = subprocess.run(command, cwd=REPO_ROOT, env=env).returncode
        seconds = time.monotonic() - started
        facts = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
        outcomes = _outcomes(junit) if junit.exists() else []
        text = render(facts, outcomes, seconds, full=not args.ci, basetemp=str(basetemp))
    text = _keep_chaos_section(text, args.output)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    temporary = args.output.with_name(f".{args.output.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, args.output)
    print(f"reliability: {args.output} ({'passed' if returncode == 0 else f'pytest exit {returncode}'})")
    return returncode


def _keep_chaos_section(text: str, previous: Path) -> str:
    """The chaos soak's table (tests/chaos/report.py, between its markers) survives a rewrite."""
    from tests.chaos.report import END, START

    old = previous.read_text() if previous.exists() else ""
    if START not in old or END not in old:
        return text
    block = START + old.partition(START)[2].partition(END)[0] + END
    return text.rstrip("\n") + "\n\n" + block + "\n"


def _outcomes(junit: Path) -> list[dict]:
    outcomes = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
            elif child.tag == "skipped":
                status = "skipped"
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcomes.append({"name": name, "status": status, "seconds": float(case.get("time", 0))})
    return outcomes


def render(facts: list[dict], outcomes: list[dict], seconds: float, *, full: bool, basetemp: str) -> str:
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for fact in facts:
        by_kind[fact["kind"]].append(fact)
    counts = defaultdict(int)
    for outcome in outcomes:
        counts[outcome["status"]] += 1
    interruptions = by_kind["interruption"]
    kills = [i for i in interruptions if i["kill9"]]
    bitwise = by_kind["bitwise"]
    bad = by_kind["bad_input"]
    lines = [
        "# Reliability report",
        "",
        f"Regenerate: `make reliability` (= `python -m tests.reliability.report`{'' if full else ' --ci'}); "
        "CI runs the same tests with 3 kill points inside `make test`.",
        "",
        f"- when: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit {_commit()}, "
        f"{platform.machine()} with {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
        f"torch {_torch_version()}",
        f"- suite: {'slow (RELIABILITY_FULL=1: 10 kill points)' if full else 'CI subset (3 kill points)'}, "
        f"{len(outcomes)} tests: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped, in {seconds / 60:.1f} min",
        "",
        "## Summary",
        "",
        "| what | result |",
        "|---|---|",
        f"| kill -9 survived (resumed bitwise) | {len(kills)} |",
        f"| SIGTERM survived (checkpoint, exit 75, resume) | {len(interruptions) - len(kills)} |",
        *(
            f"| bitwise: uninterrupted vs interrupted run | {b['steps']} steps ({b['metric_records']} metric "
            f"records incl. replayed steps) and {b['checkpoint_files']} final checkpoint files identical |"
            for b in bitwise
        ),
        f"| Inf/NaN on one rank: step skipped everywhere, state unchanged | "
        f"{', '.join(n['optim'] for n in by_kind['nonfinite']) or 'not run'} |",
        f"| bad-input cases: one-line error naming file/key, non-zero exit, nothing destroyed | {len(bad)} "
        f"(+ {sum(1 for o in outcomes if '::test_any_' in o['name'])} property-based tests) |",
        f"| checkpoint atomicity cases | {len(by_kind['atomicity'])} |",
        *(f"| security: {s['check']} | {_security(s)} |" for s in by_kind["security"]),
        f"| faults (dying/stalled rank, full disk, world-size change, corrupted shard): clear state, nothing "
        f"lost beyond the step in progress | {len(by_kind['fault'])} |",
        "",
    ]
    if by_kind["fault"]:
        lines += [
            "## Faults beyond kill -9 (tests/reliability/test_faults.py, test_corrupt_shard.py)",
            "",
            "Time to a clear state: from the fault to the line that names it (a stall: includes "
            "`dist.timeout_s`); 0 where training went on. Steps lost: finished steps that had to be "
            "trained again.",
            "",
            "| fault | where injected | outcome | time to a clear state | steps lost |",
            "|---|---|---|---|---|",
            *(
                f"| {f['fault']} | {f['injected']} | {_clean(f['outcome'], basetemp)} | {f['seconds']} s "
                f"| {f['steps_lost']} |"
                for f in by_kind["fault"]
            ),
            "",
        ]
    if interruptions:
        lines += [
            "## Interruptions of one 2-rank 1-bit LAMB job (torchrun, gloo), in order",
            "",
            "Each launch carries the next fault (`BERT_LAMB_TEST_FAULT`, pretrain/distributed/faults.py) and "
            "resumes with `resume=auto` from what the previous one left; the end result is compared with an "
            "uninterrupted run bit for bit (every non-timing metric of every step, model, optimizer "
            "states with the 1-bit error buffers, RNG, data cursor).",
            "",
            "| # | interruption | fault | newest complete checkpoint after it | launch time |",
            "|---|---|---|---|---|",
            *(
                f"| {n} | {i['name']} | `{i['fault']}` | step {i['resumed_from']} | {i['seconds']} s |"
                for n, i in enumerate(interruptions, 1)
            ),
            "",
        ]
    if bad:
        lines += [
            "## Bad input",
            "",
            "| case | exit | first line of the error |",
            "|---|---|---|",
            *(
                f"| {b['case']} | {b['exit_code']} | `{_clean(b['message'], basetemp)}` |"
                for b in sorted(bad, key=lambda b: b["case"])
            ),
            "",
        ]
    failed = [o for o in outcomes if o["status"] == "failed"]
    lines += ["## Tests", "", "| test | outcome | seconds |", "|---|---|---|"]
    lines += [f"| `{o['name']}` | {o['status']} | {o['seconds']:.1f} |" for o in outcomes]
    if failed:
        lines += ["", f"**{len(failed)} failed**: " + ", ".join(f"`{o['name']}`" for o in failed)]
    return "\n".join(lines) + "\n"


def _security(fact: dict) -> str:
    if "files_scanned" in fact:
        return f"{fact['files_scanned']} files scanned, {fact['leaks']} contain the planted key"
    return (
        f"{fact['files']} Python files, {fact['torch_load_calls']} torch.load calls, {fact['unsafe']} unsafe"
    )


def _clean(message: str, basetemp: str) -> str:
    return message.replace(basetemp, "<tmp>").replace(str(REPO_ROOT), "<repo>").replace("|", "\\|")


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True)
    return (done.stdout.strip() or "unknown") + (" + uncommitted changes" if dirty.stdout.strip() else "")


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
