"""`switchsim bench`: the runner. Each benchmark lives where its readers look for it (micro.py: codec kernels
and switch packets/s; allreduce.py: allreduce sweeps against gloo; bench_sparse.py, convergence.py,
bench_bmv2.py); report.py prints and plots. Every figure is a ratio to a baseline measured in the same run
on the same machine."""
from __future__ import annotations

import json
import os
import sys

from .allreduce import bench_allreduce, bench_block_sparse
from .micro import bench_codecs, bench_core
from .report import nccl_table, plot, table

BENCHMARKS = ("codecs", "switch", "allreduce", "blocksparse", "sparse", "sparcml", "train")  # `bench all`, in order


def bench_switch(packets: int = 100_000, workers: int = 4, backend: str = "core", rates=(), seconds: float = 1.0,
                 repeats: int = 3, window: int = 24) -> list[dict]:
    """Packets/s of the switch backends. core: the Python model and the C core in this process (micro.py);
    bmv2: the P4 program next to reference programs, measured alternately (bench_bmv2.py)."""
    if backend == "bmv2":
        from .bench_bmv2 import bench_bmv2

        return bench_bmv2(rates, seconds, repeats, window)
    return bench_core(packets, workers)


def run_benchmarks(runs: dict[str, dict], as_json: bool = False, plot_path: str | None = None) -> int:
    """Run benchmarks and print their rows (a table each, or one JSON object).

    Args:
        runs: benchmark name (one of BENCHMARKS) -> keyword arguments of its function (bench_codecs,
            bench_switch, bench_allreduce, bench_block_sparse, bench_sparse.bench_sparse,
            bench_sparse.bench_sparcml, convergence.run), run in BENCHMARKS order so `bench all` reads
            the same whatever order the caller built the dict in.
        as_json: print one JSON object keyed by benchmark (train adds "exponent_histogram") and no
            progress lines, so a script can parse the output (progress lines go only to a terminal anyway).
        plot_path: a PNG for codecs/switch/allreduce/blocksparse; train writes `<base>-train<ext>` next to
            it, since its panels do not fit the others' figure.

    Returns:
        The process exit status (0).

    Raises:
        ValueError: a name that is not a benchmark (before anything runs, not after an hour of them).
    """
    unknown = set(runs) - set(BENCHMARKS)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}")
    progress = None if as_json or not sys.stderr.isatty() else (lambda s: print(f"... {s}", file=sys.stderr))
    results, train = {}, None
    for name in (n for n in BENCHMARKS if n in runs):
        kwargs = runs[name]
        if name == "codecs":
            results[name] = bench_codecs(**kwargs)
        elif name == "switch":
            results[name] = bench_switch(**kwargs)
        elif name == "allreduce":
            results[name] = bench_allreduce(**kwargs, progress=progress)
        elif name == "blocksparse":
            results[name] = bench_block_sparse(**kwargs, progress=progress)
        elif name in ("sparse", "sparcml"):
            from . import bench_sparse

            results[name] = (bench_sparse.bench_sparse if name == "sparse" else bench_sparse.bench_sparcml)(**kwargs)
        elif name == "train":
            from . import convergence

            train = convergence.run(**kwargs)
            results[name] = convergence.main_rows(train)
    if as_json:
        print(json.dumps({**results, **({"exponent_histogram": train["exponents"]} if train else {})}, indent=2))
    else:
        for key, rows in results.items():
            print(f"\n== {key}\n{nccl_table(rows) if key == 'allreduce' else table(rows)}")
    if plot_path:
        if set(results) & {"codecs", "switch", "allreduce", "blocksparse"}:
            plot(results, plot_path)
        if train:
            from . import convergence

            base, ext = os.path.splitext(plot_path)
            convergence.plot(train, f"{base}-train{ext or '.png'}")
    return 0
