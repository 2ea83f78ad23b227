"""`python -m tests.chaos` (`make chaos SEED=... FAULTS=...`): one chaos soak (tests/chaos/soak.py), its
summary as JSON under results/chaos/, and the chaos table of results/reliability.md from every summary
there.

    python -m tests.chaos --seed 1 --faults 50                     # 1-bit LAMB (default)
    python -m tests.chaos --seed 2 --faults 50 --optim lamb
    python -m tests.chaos --report                                 # only rewrite the table

Exit code 0 when the soak passed (every verdict holds), 1 otherwise; the summary is written either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from data.config import REPO_ROOT
from tests.chaos import netjob
from tests.chaos.report import write_table
from tests.chaos.schedule import KINDS, RECIPES

RESULTS = REPO_ROOT / "results" / "chaos"


def prepared_data(workdir: Path) -> Path:
    """The tests' tiny data (data=tiny, a 2,000-token vocabulary: a small embedding), prepared once."""
    from data.prepare import prepare_in_subprocess

    folder = workdir / "tiny-data"
    if not (folder / "seq512" / "manifest.json").exists():
        prepare_in_subprocess(
            folder, "data=tiny", "data.tokenizer.vocab_file=null", "data.tokenizer.vocab_size=2000"
        )
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--optim", default="onebit_lamb", choices=("onebit_lamb", "lamb"))
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {KINDS}")
    parser.add_argument(
        "--recipe",
        default="demo",
        choices=sorted(RECIPES),
        help="demo: 40 + 10 steps (default); short: 16 + 4",
    )
    parser.add_argument("--timeout-s", type=float, default=20.0, help="dist.timeout_s of the run")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a new temp one)")
    parser.add_argument("--data", type=Path, default=None, help="prepared tiny data (default: prepare it)")
    parser.add_argument("--out", type=Path, default=None, help="summary JSON (default results/chaos/...)")
    parser.add_argument("--report", action="store_true", help="only rewrite the chaos table")
    args = parser.parse_args(argv)
    if args.report:
        write_table(RESULTS)
        return 0
    from tests.chaos.soak import Soak

    os.environ.setdefault("NETNS_PREFIX", netjob.DEFAULT_PREFIX)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    soak = Soak(
        workdir, args.data or prepared_data(workdir), seed=args.seed, faults=args.faults, optim=args.optim,
        kinds=kinds, recipe=RECIPES[args.recipe], timeout_s=args.timeout_s,
        say=lambda line: print(line, flush=True),
    )  # fmt: skip
    summary = soak.run()
    out = args.out or RESULTS / f"seed{args.seed}-{args.optim}-{args.faults}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    verdict = "PASSED" if summary["passed"] else "FAILED"
    print(
        f"chaos: seed {args.seed} {args.optim}: {verdict}: {summary['faults_struck']} faults, "
        f"{summary['restarts']} restarts, bitwise {summary['bitwise']}, lost per fault median "
        f"{summary['seconds_lost']['median']} s, worst {summary['seconds_lost']['worst']} s -> {out}"
    )
    for problem in summary["problems"]:
        print(f"chaos: problem: {problem}")
    if out.parent == RESULTS:
        write_table(RESULTS)
    if args.workdir is None and summary["passed"]:  # a temporary scratch folder: logs kept only on failure
        shutil.rmtree(workdir, ignore_errors=True)
    elif not summary["passed"]:
        print(f"chaos: logs in {workdir / 'soak'}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
