"""Study plots as PNG files: Pareto front, optimisation history, per-sublayer skip frequency."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from layerskip.fileio import write_bytes_atomic  # noqa: E402
from layerskip.search.space import trial_policy  # noqa: E402

PLOT_FILES = ("pareto.png", "history.png", "skip_frequency.png")  # what write_plots writes into --plots


def _save(fig: plt.Figure, path: Path) -> Path:
    """``fig`` as a PNG at ``path``, atomically (never over a FIFO or device: savefig would block on one)."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return write_bytes_atomic(path, buffer.getvalue())


def _complete(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def plot_pareto(study: optuna.Study, path: Path) -> Path:
    trials = [t for t in _complete(study) if "acceptance" in t.user_attrs]
    front = {t.number for t in study.best_trials} if len(study.directions) > 1 else set()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    xs = [t.user_attrs["draft_seconds"] * 1000 for t in trials]
    ys = [t.user_attrs["acceptance"] for t in trials]
    colors = [t.user_attrs.get("predicted_speedup", 0.0) for t in trials]
    points = ax.scatter(xs, ys, c=colors, cmap="viridis", s=22)
    fig.colorbar(points, ax=ax, label="predicted speedup")
    on_front = sorted((x, y) for t, x, y in zip(trials, xs, ys) if t.number in front)
    if on_front:
        ax.plot(*zip(*on_front), color="crimson", lw=1.2, marker="o", mfc="none", label="Pareto front")
        ax.legend(loc="lower right")
    ax.set(xlabel="draft step latency (ms, measured)", ylabel="teacher-forced acceptance")
    ax.set_title(f"{study.study_name}: acceptance vs draft latency")
    return _save(fig, path)


def plot_history(study: optuna.Study, path: Path) -> Path:
    trials = [t for t in _complete(study) if "predicted_speedup" in t.user_attrs]
    fig, ax = plt.subplots(figsize=(6, 4))
    numbers = [t.number for t in trials]
    values = [t.user_attrs["predicted_speedup"] for t in trials]
    ax.scatter(numbers, values, s=14, label="trial")
    if values:
        ax.plot(numbers, np.maximum.accumulate(values), color="crimson", label="best so far")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="trial", ylabel="predicted speedup vs plain decoding")
    ax.set_title(f"{study.study_name}: optimisation history")
    ax.legend()
    return _save(fig, path)


def skip_frequency(study: optuna.Study, top_fraction: float = 0.25) -> np.ndarray:
    """``[num_layers, 2]`` how often each (attention, MLP) sublayer is skipped among the best trials."""
    layers = int(study.user_attrs.get("model_num_layers", 0))
    # Lookup-only trials skip nothing by construction; they would only dilute the map.
    skip_drafts = [t for t in _complete(study) if trial_policy(study, t).draft.use_skip_draft]
    trials = sorted(skip_drafts, key=lambda t: t.user_attrs.get("predicted_speedup", 0.0), reverse=True)
    good = trials[: max(1, int(len(trials) * top_fraction))]
    counts = np.zeros((layers, 2))
    for trial in good:
        policy = trial_policy(study, trial)
        counts[list(policy.skip_attention), 0] += 1
        counts[list(policy.skip_mlp), 1] += 1
    return counts / max(1, len(good))


def plot_importance(study: optuna.Study, path: Path) -> Path:
    frequency = skip_frequency(study)
    fig, ax = plt.subplots(figsize=(3.2, max(3.0, 0.18 * len(frequency) + 1)))
    image = ax.imshow(frequency, aspect="auto", cmap="magma", vmin=0, vmax=1)
    ax.set_xticks([0, 1], ["attention", "MLP"])
    ax.set_ylabel("layer")
    ax.set_title("skipped among best 25%\nof skip-draft trials", fontsize=9)
    fig.colorbar(image, ax=ax, label="fraction of trials")
    return _save(fig, path)


def write_plots(study: optuna.Study, directory: str | Path) -> list[Path]:
    Path(directory).mkdir(parents=True, exist_ok=True)
    plots = (plot_pareto, plot_history, plot_importance)  # in PLOT_FILES' order
    return [plot(study, Path(directory) / name) for plot, name in zip(plots, PLOT_FILES)]
