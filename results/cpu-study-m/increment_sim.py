"""What the 1-bit exchange's sign error does to the averaged momentum when it compresses the whole local
momentum (the default) or only its increment (`optim.exchange_increment`): a synthetic model, no training.

A 256 × 256 matrix; each step every one of n workers has the gradient g_w = snr·μ_t + √n·ξ_w (μ_t a slowly
drifting signal, ξ_w unit Gaussian noise: the workers' average has noise of std 1 whatever n). The exact
momentum is m ← β1·m + (1−β1)·ḡ. The compressed exchange is the project's structure: each worker compresses
x_w (+ its error feedback) to sign(x)·mean|x| per column, the average (+ the server's error feedback) is
compressed again the same way. Default: x_w = β1·m̂ + (1−β1)·g_w and m̂ ← the result. Increment:
x_w = (1−β1)·g_w and m̂ ← β1·m̂ + the result. Reported over steps 100–300: the mean cosine of m̂ to the
exact β1·m̂ₜ₋₁ + (1−β1)·ḡ (the diagnostics' `fidelity_cos`) and the relative error of the summed
momenta Σm̂ against Σm (the parameters' displacement, the step's scale aside).

    .venv/bin/python results/cpu-study-m/increment_sim.py
"""

from __future__ import annotations

import numpy as np

SIZE, BETA1, STEPS, SETTLE = 256, 0.9, 300, 100


def compress(x: np.ndarray) -> np.ndarray:
    """One sign per element, one mean-|x| scale per column."""
    return np.where(x >= 0, 1.0, -1.0) * np.abs(x).mean(axis=0, keepdims=True)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))


def run(workers: int, snr: float, increment: bool) -> tuple[float, float]:
    rng = np.random.default_rng(1)
    signal = rng.standard_normal((SIZE, SIZE))
    exact, averaged = np.zeros((SIZE, SIZE)), np.zeros((SIZE, SIZE))
    worker_errors, server_error = np.zeros((workers, SIZE, SIZE)), np.zeros((SIZE, SIZE))
    summed, summed_averaged = np.zeros((SIZE, SIZE)), np.zeros((SIZE, SIZE))
    cosines, errors = [], []
    for step in range(STEPS):
        signal = 0.99 * signal + np.sqrt(1 - 0.99**2) * rng.standard_normal((SIZE, SIZE))
        grads = snr * signal + np.sqrt(workers) * rng.standard_normal((workers, SIZE, SIZE))
        reference = BETA1 * averaged + (1 - BETA1) * grads.mean(0)
        exact = BETA1 * exact + (1 - BETA1) * grads.mean(0)
        local = (1 - BETA1) * grads + (0.0 if increment else BETA1 * averaged[None])
        local = local + worker_errors
        sent = np.stack([compress(x) for x in local])
        worker_errors = local - sent
        mean = sent.mean(0) + server_error
        result = compress(mean)
        server_error = mean - result
        averaged = BETA1 * averaged + result if increment else result
        summed += exact
        summed_averaged += averaged
        if step >= SETTLE:
            cosines.append(cosine(averaged, reference))
            errors.append(np.linalg.norm(summed_averaged - summed) / np.linalg.norm(summed))
    return float(np.mean(cosines)), float(np.mean(errors))


def main() -> None:
    print("snr | workers | momentum: cos, Σ error | increment: cos, Σ error")
    for snr in (0.3, 1.0, 3.0):
        for workers in (2, 8, 32):
            (cos_m, err_m), (cos_i, err_i) = run(workers, snr, False), run(workers, snr, True)
            print(f"{snr} | {workers} | {cos_m:.3f}, {err_m:.3f} | {cos_i:.3f}, {err_i:.3f}", flush=True)


if __name__ == "__main__":
    main()
