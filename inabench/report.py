"""How benchmark rows are shown: nccl-tests' columns, plain tables, the plots."""
from __future__ import annotations


NCCL_COLUMNS = ("size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong")


def _fmt_size_row(r: dict, spread: bool = False) -> str:
    """One nccl-tests-like line: right-aligned, time in us to 1 decimal, GB/s to 2; with spread (--repeat),
    the min and max of the runs and the ratio to gloo's median after nccl-tests' columns."""
    if "error" in r:
        return f"{r['size']:>12}  {r['size'] // 4:>12}  error: {r['error']}"
    busbw = "-" if r.get("busbw") is None else f"{r['busbw']:.2f}"
    wrong = "N/A" if r.get("#wrong") is None else str(r["#wrong"])
    line = (f"{r['size']:>12}  {r['count']:>12}  {r['type']:>6}  {r.get('redop', '-'):>5}  {r['time']:>10.1f}  "
            f"{r['algbw']:>7.2f}  {busbw:>7}  {wrong:>6}")
    if spread:
        ratio = "-" if r.get("x gloo") is None else f"{r['x gloo']:.2f}"
        lo, hi = (f"{r[k]:.1f}" if r.get(k) is not None else "-" for k in ("min us", "max us"))
        line += f"  {lo:>10}  {hi:>10}  {ratio:>6}"
    return line


def nccl_table(rows: list[dict]) -> str:
    """The allreduce rows as nccl-tests prints them: one block per configuration, a header line each."""
    head = (f"#{'size':>11}  {'count':>12}  {'type':>6}  {'redop':>5}  {'time':>10}  {'algbw':>7}  {'busbw':>7}  "
            f"{'#wrong':>6}\n#{'(B)':>11}  {'(elements)':>12}  {'':>6}  {'':>5}  {'(us)':>10}  {'(GB/s)':>7}  "
            f"{'(GB/s)':>7}  {'':>6}")
    repeat = max((r.get("repeat", 1) for r in rows), default=1)
    if repeat > 1:
        head = "\n".join(h + tail for h, tail in zip(head.split("\n"), (f"  {'min':>10}  {'max':>10}  {'x gloo':>6}",
                                                                          f"  {'(us)':>10}  {'(us)':>10}  {'':>6}")))
    lines = ["# busbw = algbw * 2(n-1)/n (nccl-tests' allreduce); #wrong: elements outside the codec's bound",
             "# INA: out of place into a preallocated buffer (allreduce(x, out=y), nccl-tests' recvbuff); "
             "gloo and torch ina (init_process_group(\"ina\")): in place (all_reduce(t); the input copied in "
             "again, untimed, before it grows by 2^32); "
             "\"plain\": y = allreduce(x), as users call it, in batches alternating with out= in the same "
             "processes (x out: plain over out=, per pair of batches, the median); torch ina's x hostlib: its "
             "calls over hostlib's out= calls, in batches alternating in the same processes (the median)"]
    if repeat > 1:
        lines.append(f"# time: the median of {repeat} runs of each configuration, alternating (every other round in "
                     f"reverse order); min, max: of those runs; x gloo: time / gloo's median time")
    for config in dict.fromkeys(r["config"] for r in rows):
        block = [r for r in rows if r["config"] == config]
        note = ("memory bound: np.copyto of the same buffer, one core (algbw = size / copy time)"
                if block[0]["backend"] == "memory" else
                f"{config}: {'in place' if block[0].get('in place') else 'out of place'}")
        for name in ("x out", "x hostlib"):
            if block[0].get(name) is not None:
                note += f"; {name} " + ", ".join(f"{r[name]:.3f}" for r in block if r.get(name) is not None)
        if block[0].get("hostlib here us") is not None:
            note += " (hostlib's calls there " + ", ".join(f"{r['hostlib here us']:.0f}" for r in block) + " us)"
        if block[0].get("recoveries") is not None:
            note += f"; no store operation per call ({block[0]['recoveries']} recoveries)"
            if block[0].get("gloo calls"):
                note += f"; {block[0]['gloo calls']} calls fell back to gloo"
        lines += ["", f"# {note}", head, *(_fmt_size_row(r, repeat > 1) for r in block)]
    return "\n".join(line.rstrip() for line in lines)


def table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot without a display, or a clear exit naming the extra that brings it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("switchsim bench --plot needs matplotlib: pip install -e '.[bench]'") from None
    return plt


def _allreduce_panel(ax, rows: list[dict], plt) -> None:
    """algbw against size, log-log: one colour per INA configuration, gloo dashed greys, np.copyto dotted black
    (the references a reader compares against)."""
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    ina = [c for c in configs if not c.startswith(("gloo", "np.copyto"))]
    for config in configs:
        pts = sorted((r["size"], r["algbw"]) for r in rows if r["config"] == config and "algbw" in r)
        if not pts:
            continue
        if config == "np.copyto":
            style = {"color": "black", "linestyle": ":", "label": "memory bound: np.copyto, same buffer"}
        elif config.startswith("gloo"):
            shade = ("dimgray", "darkgray", "silver")[[c for c in configs if c.startswith("gloo")].index(config) % 3]
            style = {"color": shade, "linestyle": "--", "label": f"{config} (torch gloo, float32)"}
        else:
            style = {"color": colors[ina.index(config) % len(colors)], "linestyle": "-", "label": config}
        ax.plot(*zip(*pts), marker="o", markersize=3, **style)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: next(
        f"{v / m:g}{u}" for m, u in ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K"), (1, "")) if v >= m or m == 1)))
    ax.set_yscale("log")
    ax.set_xlabel("size: bytes of float32 per worker")
    ax.set_ylabel("algbw (GB/s) = size / time")
    ax.legend(fontsize=7)


def plot(results: dict, path: str) -> None:
    plt = pyplot()
    panels = [k for k in ("codecs", "switch", "allreduce", "blocksparse") if results.get(k)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = results.get(key)
        if key == "codecs":
            ax.barh([r["what"] for r in rows], [r["x copyto"] for r in rows])
            ax.set_xlabel("throughput / np.copyto (same buffer)")
        elif key == "switch":
            ax.barh([r["what"] for r in rows], [r["packets/s"] for r in rows])
            ax.set_xscale("log")
            ax.set_xlabel("packets/s")
        elif key == "blocksparse":  # time against density, at the largest size measured
            mib = max(r["MiB"] for r in rows)
            timed = [r for r in rows if r["MiB"] == mib and "seconds" in r]
            timed_ina = [r for r in timed if r.get("density")]
            configs = sorted({(r["backend"], r["codec"], r["workers"]) for r in timed_ina})
            colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
            for i, cfg in enumerate(configs):  # one colour per configuration: dashed dense, solid block-sparse
                for mode in ("dense", "block-sparse"):
                    pts = sorted((r["density"], r["seconds"]) for r in timed_ina
                                 if (r["backend"], r["codec"], r["workers"]) == cfg and r["mode"] == mode)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", color=colors[i % len(colors)],
                                linestyle="-" if mode == "block-sparse" else "--",
                                label=f"{cfg[0]}/{cfg[1]} x{cfg[2]} {mode}")
            for r in timed:
                if r["backend"] == "gloo":
                    ax.axhline(r["seconds"], color="grey", linewidth=0.8, linestyle=":" if r["workers"] > 2 else "-",
                               label=f"gloo x{r['workers']} (dense float32)")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(f"fraction of non-zero blocks per worker ({mib} MiB)")
            ax.set_ylabel("allreduce seconds")
            ax.legend(fontsize=7)
        elif key == "allreduce":
            _allreduce_panel(ax, rows, plt)
        ax.set_title(key)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
