"""The figures of ``bench/dp/perfmodel.py``: ACCO's modelled speed-up over ZeRO-1 against the
inter-node bandwidth (:func:`plot`) and the quantized variants' time per update (:func:`plot_quantized`).
Each returns False, with a log line, where matplotlib is not installed."""

from __future__ import annotations

from pathlib import Path

from bench import common


def plot(sw: dict, path: Path) -> bool:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
  except ImportError:
    common.log("matplotlib is not installed: no figure (pip install matplotlib)")
    return False
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, (title, curves) in zip(axes, sw["panels"].items(), strict=True):
    for color, (n, c) in zip(colors, curves.items(), strict=False):
      ax.plot(sw["gbit"], c["acco"], color=color, label=f"ACCO fixed k, N={n}")
      ax.plot(
        sw["gbit"], c["acco_adaptive"], color=color, ls="--", lw=1, label=f"ACCO adaptive, N={n}"
      )
    ax.plot(
      sw["gbit"],
      curves[8]["acco_single_loop"],
      color="black",
      ls=":",
      lw=1.5,
      label="ACCO one loop/stage, N=8",
    )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axvline(100, color="gray", ls="-.", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(0.45, 6)
    ax.set_yticks([0.5, 1, 1.5, 2, 3, 4, 6], ["0.5", "1", "1.5", "2", "3", "4", "6"])
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_title(f"GPT-Neo {title}, A100 @ 30% MFU")
    ax.set_xlabel("inter-node bandwidth (Gbit/s, nominal; 80% usable)")
    ax.grid(True, which="both", alpha=0.3)
  axes[0].set_ylabel("speed-up over ZeRO-1 (one reduction per update)")
  axes[1].legend(fontsize=7, ncol=2, loc="lower right")
  fig.suptitle(
    "Modelled ACCO speed-up over ZeRO-1 vs bandwidth (one worker per node; dash-dot: 100 Gb/s)"
  )
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  return True


def plot_quantized(out: dict, path: Path) -> bool:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    common.log("matplotlib is not installed: no figure (pip install matplotlib)")
    return False
  styles = {
    "zero1": ("gray", "--"),
    "acco": ("k", "-"),
    "zero1-int8": ("tab:blue", "--"),
    "acco-int8": ("tab:blue", "-"),
    "acco-int4": ("tab:red", "-"),
    "acco-int8-flat": ("tab:blue", ":"),
  }
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
  for ax, cal in zip(axes, ("A", "B"), strict=True):
    d = out[cal]
    for label, curve in d["curves"].items():
      color, ls = styles[label]
      ax.plot(out["gbit"], curve, color=color, ls=ls, label=label)
    ax.axhline(d["compute_s"], color="gray", lw=0.6)
    for label in ("acco", "acco-int8", "acco-int4"):
      ax.axvline(d["compute_bound_below_gbit"][label], color=styles[label][0], lw=0.6, ls="-.")
    ax.set(
      xscale="log",
      yscale="log",
      xlabel="inter-node bandwidth (Gbit/s, nominal; 80% usable)",
      title=f"calibration {cal} ({100 * d['info']['mfu']:.0f}% MFU)",
    )
    ax.grid(True, which="both", alpha=0.3)
  axes[0].set_ylabel("time per update (s)")
  axes[1].legend(fontsize=8)
  fig.suptitle("GPT-Neo 125M on 4 x 8 A100: time per update; dash-dot: ACCO compute-bound above")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  return True
