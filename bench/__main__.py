"""`python -m bench [name ...]` runs every benchmark module listed in BENCHMARKS (or the named ones).

Those in OPT_IN run only when named: `net` needs root and takes ~15 minutes (`make bench-net`),
`scaling` reads net's results, and `fidelity` turns the CPU study's comparison into records.
"""

from __future__ import annotations

import importlib
import sys

# name -> module with a `main(argv: list[str]) -> None` that writes results/bench/<name>.json
BENCHMARKS: dict[str, str] = {
    "data_prep": "bench.data_prep",
    "comm": "bench.comm",
    "optim": "bench.optim",
    "trainer": "bench.trainer",
    "finetune": "bench.finetune",
    "net": "bench.net",
    "scaling": "bench.scaling",
    "fidelity": "bench.fidelity",
    "gpu": "bench.gpu",
}
OPT_IN = {"net", "scaling", "fidelity", "gpu"}


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nbenchmarks:", ", ".join(n + (" (opt-in)" if n in OPT_IN else "") for n in BENCHMARKS))
        print("`python -m bench NAME --help` shows one benchmark's options.")
        return
    names = [a for a in argv if not a.startswith("-")] or [n for n in BENCHMARKS if n not in OPT_IN]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"bench: unknown benchmark(s) {unknown}; known: {sorted(BENCHMARKS)}")
    for name in names:
        importlib.import_module(BENCHMARKS[name]).main([a for a in argv if a.startswith("-")])


if __name__ == "__main__":
    main(sys.argv[1:])
