"""Training curves of embedded runs: one PNG of per-step panels (matplotlib, optional).

Panels: reward (and DPO's held-out preference accuracy), loss, KL to the reference,
entropy, importance ratios, training tokens/s and, for a run with `run.speculative`, the
sampler's acceptance length and speed-up, against the global step. The warm
start is shaded and labelled `SFT`; the loss's steps carry its name. Several runs
overlay in one figure, one colour per run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# (title, [(metric key, line style)]); a key a run does not log is left out
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("reward", (("reward", "-"), ("preference_accuracy", ":"))),
    ("loss (symmetric log scale)", (("loss", "-"),)),
    ("KL to the reference (kl_penalty)", (("kl_penalty", "-"),)),
    ("entropy (sampled −log p; approx_entropy dashed)", (("entropy", "-"), ("approx_entropy", "--"))),
    ("importance ratio (sampling; probs_ratio dashed)", (("sampling_importance_ratio", "-"), ("probs_ratio", "--"))),
    ("training tokens/s", (("tokens_per_s", "-"),)),
    (
        "speculative sampling: τ (tokens per policy forward); speed-up dashed",
        (("speculative_tau", "-"), ("speculative_speedup", "--")),
    ),
)
WARM_START = "sft"  # the phase name of warm-start steps in `metrics.jsonl`; the others carry the loss's name


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The per-step records of a run directory's `metrics.jsonl`. A last line without its
    newline that does not parse is one the run is still writing: it is skipped, with a line
    on stderr saying so. Any other line that is not a JSON object with a `step` is a
    ValueError naming the file and the line."""
    file = Path(run_dir) / "metrics.jsonl"
    # undecodable bytes become U+FFFD, so they fail as JSON on their line; the last item is
    # what follows the last newline ("" when the file ends with one)
    lines = file.read_text(errors="replace").split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                print(
                    f"{file}:{number}: skipped the incomplete last line (a run still writing it, or a file cut short)",
                    file=sys.stderr,
                )
                continue
            raise ValueError(f"{file}:{number}: not a JSON line (column {e.colno}: {e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{file}:{number}: not a metrics record (a JSON object with an integer 'step')")
        records.append(record)
    return records


def plot_runs(runs: list[tuple[str, list[dict[str, Any]]]], out: Path) -> Path:
    """Draw `(label, records)` runs into `out` (PNG); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the speculative-decoding panel only for runs that log it
    panels = [p for p in PANELS if p is not PANELS[-1] or any(k in r for _, rs in runs for r in rs for k, _ in p[1])]
    rows = -(-len(panels) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(15, 3.75 * rows), sharex=True)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (label, records), colour in zip(runs, colours * (len(runs) // len(colours) + 1)):
        warm = [r["step"] for r in records if r.get("phase") == WARM_START]
        main = sorted({r["phase"] for r in records if r.get("phase") != WARM_START})
        name = f"{label} ({', '.join(([WARM_START.upper()] if warm else []) + main)})"
        for ax, (title, keys) in zip(axes.flat, panels):
            for key, style in keys:
                points = [(r["step"], r[key]) for r in records if key in r]
                if points:
                    ax.plot(
                        *zip(*points),
                        style,
                        color=colour,
                        lw=1.2,
                        label=f"{name} {key}" if ax is axes.flat[0] else None,
                    )
            if warm:
                ax.axvspan(min(warm) - 0.5, max(warm) + 0.5, color=colour, alpha=0.06)
                ax.axvline(max(warm) + 0.5, color=colour, ls="--", lw=0.8)
    axes.flat[1].set_yscale("symlog", linthresh=0.1)  # the warm start's NLL dwarfs a policy loss near 0
    for ax, (title, _) in zip(axes.flat, panels):
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels) - 3 : len(panels)]:
        ax.set_xlabel("step (shaded: SFT warm start)")
    axes.flat[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
