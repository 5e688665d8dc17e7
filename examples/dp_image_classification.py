"""DP image classification with dpcompile: a small GroupNorm CNN on scikit-learn's handwritten digits.

    pip install -e . scikit-learn
    python examples/dp_image_classification.py                 # epsilon 1, 3, 8 and non-private: ~2 min on 2 CPU cores
    python examples/dp_image_classification.py --epsilons 2 4 --epochs 40 --out runs/digits
    python examples/dp_image_classification.py --quick         # a few steps of a narrower net: a smoke test

The data is ``sklearn.datasets.load_digits`` (1797 8x8 grayscale images of the digits 0-9; it ships inside
scikit-learn, nothing is downloaded), split once into 1500 training and 297 test images. For every target
epsilon (at delta 1e-5) the script trains the same CNN from the same initialisation with DP-SGD through
dpcompile: Poisson-sampled batches (``dpcompile.PoissonBatchSampler``), the noise multiplier that spends
the target over the planned steps (``dpcompile.noise_multiplier_for``), per-sample clipping and
noise in the compiled step (``dpcompile.private_step``), and the privacy spent counted by
``dpcompile.PrivacyAccountant``. A non-private run of the same model, batches and optimiser (no clipping,
no noise, eager PyTorch) gives the accuracy privacy costs. Under ``--out`` (default
``runs/dp_image_classification``) it writes ``results.json`` (test accuracy and epsilon spent per target)
and ``accuracy_vs_epsilon.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import dpcompile

DELTA = 1e-5  # well below 1 / (training set size)
N_TRAIN = 1500  # of the 1797 images; the other 297 are the test set
SPLIT_SEED = 0  # the split is fixed, whatever --seed says, so every run is scored on the same images
PIXEL_MAX = 16.0  # load_digits' pixels are counts 0..16
QUICK_STEPS = 3  # per run, with --quick


# --- data ------------------------------------------------------------------------------------------------

def load_digit_images() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 images as [N, 1, 8, 8] floats in [-1, 1], and their labels.

    Scaled by the known pixel range, not by the training set's mean and std: statistics of the private
    data would themselves have to be released privately."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    return images / PIXEL_MAX * 2 - 1, torch.tensor(digits.target, dtype=torch.long)


def split_train_test(images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SPLIT_SEED))
    train, test = order[:N_TRAIN], order[N_TRAIN:]
    return {"train_x": images[train], "train_y": labels[train], "test_x": images[test], "test_y": labels[test]}


# --- model -----------------------------------------------------------------------------------------------

class DigitCNN(nn.Module):
    """conv 3x3 -> GroupNorm -> ReLU, strided conv 3x3 -> GroupNorm -> ReLU, linear over the 4x4 map.

    GroupNorm, not BatchNorm: BatchNorm mixes the samples of a batch, so a sample's gradient would depend on
    the others and per-sample clipping would not bound it. The head reads the whole 4x4 map rather than its
    global average: on 8x8 digits where a stroke is matters (in a sweep of lr and C the averaged net
    reached at most ~80% at epsilon 3, this one ~94%)."""

    def __init__(self, width: int = 16, groups: int = 4, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)  # [width, 8, 8]
        self.norm1 = nn.GroupNorm(groups, width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)  # [2 width, 4, 4]
        self.norm2 = nn.GroupNorm(groups, 2 * width)
        self.head = nn.Linear(2 * width * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm1(self.conv1(x)))
        h = F.relu(self.norm2(self.conv2(h)))
        return self.head(h.flatten(1))


# --- training --------------------------------------------------------------------------------------------

def make_dp_step(model: nn.Module, *, max_grad_norm: float, noise_multiplier: float, expected_batch_size: float,
                 seed: int, compiler: str):
    """The DP-SGD step: per-sample losses, their mean, backward; dpcompile clips and adds noise in the graph."""

    def train_step(x, y):
        loss = F.cross_entropy(model(x), y, reduction="none").mean()  # 1/B becomes 1/expected_batch_size
        loss.backward()
        return loss.detach()

    return dpcompile.private_step(train_step, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                                  expected_batch_size=expected_batch_size, seed=seed, compiler=compiler)


def make_plain_step(model: nn.Module, *, expected_batch_size: float):
    """The non-private step: the same mean gradient (sum over the batch / expected batch size), unclipped."""

    def train_step(x, y):
        loss = F.cross_entropy(model(x), y, reduction="sum") / expected_batch_size
        loss.backward()
        return loss.detach()

    return train_step


@torch.no_grad()
def accuracy_on(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(1) == y).float().mean())


def train_one(data: dict, args, *, noise_multiplier: float | None, desc: str) -> dict:
    """Trains a fresh model with the shared schedule: DP-SGD when noise_multiplier is given, else non-private.

    Every run starts from the same initial weights and draws the same Poisson batches (seed --seed), so the
    runs differ only in clipping and noise."""
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    model = DigitCNN(args.width)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    n = len(data["train_x"])
    q = args.batch / n
    steps = planned_steps(args, q)
    # fixed seeds, for a reproducible example; a real run keeps its sampling and noise seeds secret (they
    # reveal which examples were in which batch, and the noise)
    sampler = dpcompile.PoissonBatchSampler(n, sample_rate=q, steps=steps, seed=args.seed)
    private = noise_multiplier is not None
    if private:
        step = make_dp_step(model, max_grad_norm=args.max_grad_norm, noise_multiplier=noise_multiplier,
                            expected_batch_size=sampler.expected_batch_size, seed=args.seed + 1,
                            compiler=args.compiler)
        accountant = dpcompile.PrivacyAccountant(noise_multiplier=noise_multiplier, sample_rate=q)
    else:
        step = make_plain_step(model, expected_batch_size=sampler.expected_batch_size)
    started = time.perf_counter()
    bar = tqdm(sampler, desc=desc, file=sys.stderr, dynamic_ncols=True, disable=args.no_progress)
    for t, idx in enumerate(bar):
        x, y = data["train_x"][idx], data["train_y"][idx]
        if private:
            dpcompile.mark_batch(x, y, nonempty=True)  # one graph for every batch size, empty batches included
            loss = step(x, y)
            accountant.step()
        elif idx:  # an empty batch has no gradient to take (the DP step above still adds its noise)
            loss = step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if t == 0:
            first_step = time.perf_counter() - started  # the DP step's includes its compile
        if idx:
            bar.set_postfix({"loss": f"{float(loss):.3f}"}, refresh=False)
    bar.close()
    result = {"test_accuracy": accuracy_on(model, data["test_x"], data["test_y"]), "steps": steps,
              "train_seconds": time.perf_counter() - started, "first_step_seconds": first_step}
    if private:
        result.update(noise_multiplier=noise_multiplier, epsilon_spent=accountant.epsilon(DELTA),
                      **what_dpcompile_did(step.dp_backend))
    return result


def what_dpcompile_did(backend) -> dict:
    """The evidence that the steps ran as DP graphs: how many ran, and what the rewrite of the one that holds
    the parameters' gradients counted (clip coefficients, noise added per parameter, per-sample norms)."""
    dp = [r for r in backend.compiled if r.dp]  # the step's other graph (after backward) holds no gradient
    return {"dp_graph_calls": backend.calls, "dp_graphs_compiled": len(dp),
            "dp_rewrite_counters": dict(dp[0].counters) if dp else {},
            "dropped_samples": backend.dropped_samples()}


def planned_steps(args, sample_rate: float) -> int:
    return QUICK_STEPS if args.quick else max(1, round(args.epochs / sample_rate))


# --- output ----------------------------------------------------------------------------------------------

def plot_accuracy(path: str, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    dp = results["dp"]
    eps = [r["target_epsilon"] for r in dp]
    acc = [100 * r["test_accuracy"] for r in dp]
    plain = 100 * results["nonprivate"]["test_accuracy"]
    cfg = results["config"]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.plot(eps, acc, "o-", label="DP-SGD (dpcompile)")
    for e, a in zip(eps, acc):
        ax.annotate(f"{a:.1f}%", (e, a), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax.axhline(plain, color="tab:green", ls="--", label=f"non-private {plain:.1f}%")
    ax.set_xscale("log")
    ax.minorticks_off()  # the log axis' minor labels (2x10^0, ...) would crowd the target epsilons
    ax.set_xticks(eps, [f"{e:g}" for e in eps])
    ax.set_ylim(min(acc + [plain]) - 3, max(acc + [plain]) + 2)
    ax.set_xlabel(f"target epsilon (delta = {DELTA:g})")
    ax.set_ylabel(f"test accuracy (% of {results['data']['test_images']} images)")
    ax.set_title(f"digits 8x8: GroupNorm CNN, {dp[0]['steps']} steps, expected batch {cfg['batch']}, "
                 f"C={cfg['max_grad_norm']:g}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict:
    return {"torch": torch.__version__, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine()}


def print_table(results: dict) -> None:
    print(f"{'epsilon':>10}  {'spent':>7}  {'sigma':>6}  {'test acc':>8}")
    for r in results["dp"]:
        print(f"{r['target_epsilon']:>10g}  {r['epsilon_spent']:>7.3f}  {r['noise_multiplier']:>6.3f}  "
              f"{100 * r['test_accuracy']:>7.1f}%")
    print(f"{'non-private':>10}  {'':>7}  {'':>6}  {100 * results['nonprivate']['test_accuracy']:>7.1f}%")


# --- main ------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0], help="target epsilons")
    ap.add_argument("--epochs", type=float, default=20.0, help="expected passes over the training set")
    ap.add_argument("--batch", type=int, default=256, help="expected batch size (Poisson sampling)")
    ap.add_argument("--max-grad-norm", type=float, default=0.1, help="per-sample clipping bound C")
    ap.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    ap.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    ap.add_argument("--seed", type=int, default=0, help="initial weights, batches and noise")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's intra-op threads; one, because this net's ops are too small to split (and on a "
                         "busy machine threads waiting on each other made a step 20x slower)")
    ap.add_argument("--out", default="runs/dp_image_classification", help="directory for the JSON and the plot")
    ap.add_argument("--compiler", choices=["inductor", "eager"], default=None,
                    help="dpcompile's compiler option: 'inductor' (generated kernels; the default) or 'eager' (the same "
                         "DP graphs run op by op: compiles in seconds, steps slower; the default of --quick)")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_STEPS} steps per run of a narrower net, compiler 'eager' (a smoke test)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = ap.parse_args(argv)
    if args.quick:
        args.width = min(args.width, 8)
    if args.compiler is None:
        args.compiler = "eager" if args.quick else "inductor"
    return args


def main(argv=None) -> dict:
    """Runs every target epsilon and the non-private comparison; returns what results.json holds."""
    args = parse_args(argv)
    wall = time.perf_counter()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run_all(args, wall)
    finally:
        torch.set_num_threads(threads_before)  # main() may be called in a process that goes on (the test)


def run_all(args, wall: float) -> dict:
    os.makedirs(args.out, exist_ok=True)
    data = split_train_test(*load_digit_images())
    q = args.batch / len(data["train_x"])
    steps = planned_steps(args, q)
    print(f"digits: {len(data['train_x'])} training and {len(data['test_x'])} test images; sample rate {q:.4f}, "
          f"{steps} steps per run, C={args.max_grad_norm}, lr={args.lr}")
    results = {"config": dict(vars(args)), "delta": DELTA, "machine": machine(), "dp": [],
               "data": {"train_images": len(data["train_x"]), "test_images": len(data["test_x"])}}
    with warnings.catch_warnings():
        # Opacus' RDP order search, which the PRV accountant runs to bound its domain: expected here
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        for target in args.epsilons:
            sigma = dpcompile.noise_multiplier_for(target_epsilon=target, target_delta=DELTA, sample_rate=q,
                                                   steps=steps)
            run = train_one(data, args, noise_multiplier=sigma, desc=f"DP eps={target:g}")
            results["dp"].append({"target_epsilon": target, **run})
            print(f"epsilon {target:g}: noise multiplier {sigma:.3f}, spent {run['epsilon_spent']:.3f}, "
                  f"test accuracy {100 * run['test_accuracy']:.1f}%  ({run['train_seconds']:.1f} s)")
        results["nonprivate"] = train_one(data, args, noise_multiplier=None, desc="non-private")
    print(f"non-private: test accuracy {100 * results['nonprivate']['test_accuracy']:.1f}%")
    results["wall_seconds"] = time.perf_counter() - wall
    results["json"] = os.path.join(args.out, "results.json")
    results["plot"] = os.path.join(args.out, "accuracy_vs_epsilon.png")
    with open(results["json"], "w") as f:
        json.dump(results, f, indent=1)
    plot_accuracy(results["plot"], results)
    print_table(results)
    print(f"wrote {results['json']} and {results['plot']} ({results['wall_seconds']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
