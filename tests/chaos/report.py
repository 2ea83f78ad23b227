"""The chaos table of results/reliability.md, from the soak summaries in results/chaos/*.json."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from data.config import REPO_ROOT

REPORT = REPO_ROOT / "results" / "reliability.md"
START, END = "<!-- chaos:start -->", "<!-- chaos:end -->"
RUNS = {20: "16 + 4 steps", 50: "40 + 10 steps"}  # the recipes by their last step (tests/chaos/schedule.py)
BUGS = REPO_ROOT / "tests" / "chaos" / "bugs.md"  # the bugs the soak found, with their fixes


def struck(summary: dict) -> str:
    """Faults struck / asked for, and in brackets the reserve drawn to replace faults that found no step and
    the drawn faults that never struck (tests/chaos/schedule.py `Planner`)."""
    scheduled = summary["faults_scheduled"]
    reserve = summary.get("faults_drawn", scheduled) - scheduled
    left = len(summary.get("faults_unplaced", []))
    notes = ([f"+{reserve} from the reserve"] if reserve else []) + ([f"{left} never struck"] if left else [])
    return f"{summary['faults_struck']} / {scheduled}" + (f" ({', '.join(notes)})" if notes else "")


def table(summaries: list[dict]) -> str:
    lines = [
        "| seed | optim | run | faults struck / scheduled | by kind | by point | restarts |"
        " bitwise end state | documented lines | lost per fault: median / worst | soak / uninterrupted |"
        " verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        kinds = ", ".join(f"{k} {n}" for k, n in s["by_kind"].items())
        points = ", ".join(f"{k} {n}" for k, n in s["by_point"].items())
        lost = s["seconds_lost"]
        lines.append(
            f"| {s['seed']} | {s['optim']} | {RUNS.get(s['final_step'], str(s['final_step']) + ' steps')} | "
            f"{struck(s)} | {kinds} | {points} | {s['restarts']} | "
            f"{'yes' if s['bitwise'] else 'NO'} | {s['messages_ok']} of {s['faults_struck']} | "
            f"{lost['median']} s / {lost['worst']} s | "
            f"{s['soak_seconds']:.0f} s / {s['reference_seconds']:.0f} s | "
            f"{'passed' if s['passed'] else 'FAILED: ' + '; '.join(s['problems'])[:200]} |"
        )
    return "\n".join(lines)


def by_kind_table(summaries: list[dict]) -> str:
    """Per kind over all soaks: faults, where they struck, the documented line, the time they cost."""
    rows: dict[str, list[dict]] = {}
    for s in summaries:
        for fault in s["faults"]:
            if fault["fired"]:
                kind = fault["kind"]
                if kind == "link":  # ridden out, or past dist.timeout_s
                    kind += " (short)" if fault["hold_s"] < s.get("timeout_s", 20.0) else " (long)"
                rows.setdefault(kind, []).append(fault)
    lines = [
        "| kind | faults | points | with its documented line | lost: median / worst |",
        "|---|---|---|---|---|",
    ]
    for kind, faults in sorted(rows.items()):
        points: dict[str, int] = {}
        for fault in faults:
            points[fault["point"]] = points.get(fault["point"], 0) + 1
        lost = [f["seconds_lost"] for f in faults if f["seconds_lost"] is not None]
        cost = f"{statistics.median(lost):.1f} s / {max(lost):.1f} s" if lost else "-"
        lines.append(
            f"| {kind} | {len(faults)} | {', '.join(f'{p} {n}' for p, n in sorted(points.items()))} | "
            f"{sum(1 for f in faults if f['message'] and not f['problems'])} | {cost} |"
        )
    return "\n".join(lines)


def section(summaries: list[dict], results: Path) -> str:
    struck = sum(s["faults_struck"] for s in summaries)
    bitwise = sum(1 for s in summaries if s["bitwise"])
    lost = [f["seconds_lost"] for s in summaries for f in s["faults"] if f["seconds_lost"] is not None]
    by_kind: dict[str, int] = {}
    for s in summaries:
        for kind, n in s["by_kind"].items():
            by_kind[kind] = by_kind.get(kind, 0) + n
    skipped = {k: v for s in summaries for k, v in s["skipped_kinds"].items()}
    parts = [
        START,
        "## Chaos soak (tests/chaos/, `make chaos SEED=... FAULTS=...`)",
        "",
        "One 2-rank run of the demo recipe (40 + 10 steps, freeze_step 12; or shortened to 16 + 4, "
        "freeze_step 6; a checkpoint every step, `dist.timeout_s=20`), driven through a seeded schedule of "
        "faults by `python -m "
        "launch.supervise`, which relaunches it on exit 75, 76 and a freed full disk; the end state is "
        "compared with an uninterrupted run of the same seed. Lost per fault: from the fault to the first "
        "step past the furthest one trained when the launch it ended stopped, or to the next fault, "
        "whichever came first (no second counted twice). A run holds only so many faults that move it on "
        "(a SIGTERM, a flipped byte, a short link outage, a kill after a checkpoint: a step each), so a "
        "fault that would end the run waits until it is the last one needed, a target moves onto a boundary "
        "only from 2 steps away, and while none of the schedule's faults can strike, more are drawn from "
        "the same seeded RNG (the reserve) until as many as asked for have struck; `struck / scheduled` "
        "says in brackets how many came from the reserve and how many drawn never struck. Regenerate the "
        "table: `python -m tests.chaos --report` (from results/chaos/*.json).",
        "",
        f"- soaks: {len(summaries)}; faults: {struck} "
        f"({', '.join(f'{k} {n}' for k, n in sorted(by_kind.items()))}); "
        f"bitwise end states: {bitwise} of {len(summaries)}",
        f"- lost per fault over all soaks: median {statistics.median(lost):.1f} s, worst {max(lost):.1f} s"
        if lost
        else "- lost per fault: none measured",
    ]
    if skipped:
        parts.append("- kinds skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    where = results / "where.md"  # how the soaks were run (machine, what ran beside them), one line each
    if where.exists():
        parts += [line for line in where.read_text().splitlines() if line.strip()]
    parts += ["", table(summaries), "", by_kind_table(summaries), ""]
    if BUGS.exists():
        parts += ["### Bugs the soak found", "", BUGS.read_text().strip(), ""]
    parts.append(END)
    return "\n".join(parts)


def write_table(results: Path, report: Path = REPORT) -> None:
    summaries = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    summaries.sort(key=lambda s: (s["optim"], s["seed"], s["faults_scheduled"]))
    text = report.read_text() if report.exists() else "# Reliability report\n"
    block = section(summaries, results)
    if START in text and END in text:
        head, _, rest = text.partition(START)
        _, _, tail = rest.partition(END)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    report.write_text(text)
