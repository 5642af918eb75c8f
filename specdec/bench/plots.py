"""PNG plots of benchmark results (matplotlib, Agg: no display needed)."""
from __future__ import annotations


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'specdec[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(result: dict) -> str:
    m = result["machine"]
    bw = m.get("bandwidth_gb_per_s")
    return f"{result['config']['model']} ({result['config']['dtype']}), {m['cpu_cores']} cores" + (
        f", {bw:.1f} GB/s" if bw else "")


def plot_latency(result: dict, path: str) -> None:
    """Acceptance per position (with alpha^(i+1) for reference) and decode tokens/s vs roofline."""
    plt = _pyplot()
    spec = result["speculative"]
    fig, axes = plt.subplots(1, 2 if spec else 1, figsize=(11 if spec else 5.5, 4), squeeze=False)
    ax = axes[0][0]
    names = ["no speculation"] + ([f"{spec['method']}"] if spec else [])
    values = [result["baseline"]["decode_tokens_per_s"]] + ([spec["decode_tokens_per_s"]] if spec else [])
    ax.bar(names, values, color=["tab:gray", "tab:blue"][: len(values)])
    roof = result["roofline"]["tokens_per_s"]
    if roof < 3 * max(values):
        ax.axhline(roof, color="tab:red", ls="--", label="roofline (plain decoding)")
    else:  # a tiny model: the line would flatten the bars
        ax.plot([], [], " ", label=f"roofline {roof:.0f} tok/s (off the chart)")
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    if spec:
        ax = axes[0][1]
        per_pos = spec["acceptance"]["acceptance_per_position"]
        xs = list(range(1, len(per_pos) + 1))
        ax.bar(xs, per_pos, label="measured")
        alpha = spec["acceptance"]["alpha"]
        ax.plot(xs, [alpha ** x for x in xs], "k.--", label=f"alpha^i, alpha={alpha:.2f}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted)")
        ax.set_ylim(0, 1.05)
        ax.legend()
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(result: dict, path: str) -> None:
    plt = _pyplot()
    rows = result["rows"]
    bs = [r["batch_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(bs, [r["baseline"]["decode_tokens_per_s"] for r in rows], "o-", label="decode, no speculation")
    if all("speculative" in r for r in rows):
        ax.plot(bs, [r["speculative"]["decode_tokens_per_s"] for r in rows], "s-", label="decode, speculative")
    ax.plot(bs, [r["roofline"]["tokens_per_s"] for r in rows], "r--", label="memory roofline")
    if all(r["roofline"].get("compute_tokens_per_s") for r in rows):
        ax.plot(bs, [r["roofline"]["compute_tokens_per_s"] for r in rows], "k:", label="compute roof")
        ax.set_ylim(0, 1.3 * max(max(r["roofline"]["attainable_tokens_per_s"] for r in rows),
                                 max(r["baseline"]["decode_tokens_per_s"] for r in rows)))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s")
    ax.legend()
    ax.set_title(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(result: dict, path: str) -> None:
    """Speedup vs K per acceptance (bound dashed) and the efficiency heat map over (a, K)."""
    plt = _pyplot()
    cells = result["cells"]
    ks, accs = result["config"]["ks"], result["config"]["acceptances"]
    fig, (ax, hm) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, a in enumerate(accs):
        row = sorted((c for c in cells if c["acceptance_set"] == a), key=lambda c: c["k"])
        color = f"C{i}"
        ax.plot([c["k"] for c in row], [c["speedup"] for c in row], "o-", color=color, label=f"replay a={a}")
        ax.plot([c["k"] for c in row], [c["leviathan_bound"] for c in row], "--", color=color, alpha=0.6)
    ax.set_xlabel("K (draft tokens per step)")
    ax.set_ylabel("speedup over no speculation")
    ax.set_title("measured (solid) vs Leviathan bound (dashed)", fontsize=9)
    ax.legend(fontsize=8)
    grid = [[next((c["efficiency"] for c in cells if c["acceptance_set"] == a and c["k"] == k), float("nan"))
             for k in ks] for a in accs]
    top = max([v for row in grid for v in row if v == v] + [1.05])  # verification can beat a plain step
    im = hm.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0.5, vmax=top)
    hm.set_xticks(range(len(ks)), [str(k) for k in ks])
    hm.set_yticks(range(len(accs)), [str(a) for a in accs])
    hm.set_xlabel("K")
    hm.set_ylabel("acceptance a (set)")
    for y, row in enumerate(grid):
        for x, v in enumerate(row):
            hm.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.8 else "k")
    fig.colorbar(im, ax=hm, label="efficiency = speedup / bound")
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compare(result: dict, path: str) -> None:
    plt = _pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["system"] for r in rows]
    ax.barh(names, [r["tokens_per_s"] for r in rows],
            color=["tab:orange" if n.startswith("transformers") else "tab:blue" for n in names])
    ax.axvline(result["roofline"]["tokens_per_s"], color="tab:red", ls="--", label="roofline (plain decoding)")
    ax.set_xlabel("tokens/s (end to end, batch 1)")
    ax.invert_yaxis()
    ax.legend()
    ax.set_title(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_profile(result: dict, path: str) -> None:
    """One stacked bar per engine: ms per decode step by category."""
    from specdec.bench.profile import CATEGORIES

    plt = _pyplot()
    engines = result["engines"]
    names = list(engines)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.8 * len(names)))
    left = [0.0] * len(names)
    for i, cat in enumerate(CATEGORIES):
        widths = [engines[n]["breakdown_ms"][cat] for n in names]
        ax.barh(names, widths, left=left, color=f"C{i}", label=cat)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("ms per decode step (profiled)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.set_title(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
