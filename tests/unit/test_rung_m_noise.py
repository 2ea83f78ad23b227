"""results/cpu-study-m/noise.py: a run's final, its batch noise, and pairs of runs with one seed."""

from __future__ import annotations

import importlib.util
import math
import statistics
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "results" / "cpu-study-m" / "noise.py"
spec = importlib.util.spec_from_file_location("noise", SCRIPT)
assert spec and spec.loader
noise = importlib.util.module_from_spec(spec)
spec.loader.exec_module(noise)


def test_the_final_is_the_last_ten_records_and_its_noise_their_spread_over_root_ten():
    records = {step: float(step % 2) for step in range(5, 101, 5)}  # the last ten: 0, 1, 0, 1, ...
    value, batch_noise = noise.final(records)
    assert value == 0.5
    assert math.isclose(batch_noise, statistics.stdev([0.0, 1.0] * 5) / math.sqrt(10))


def test_the_last_window_counts_only_its_steps():
    records = {step: (1.0 if step > 600 else 9.0) for step in range(5, 1001, 5)}
    assert noise.last_mean(records) == 1.0  # steps 605-1000
    assert noise.last_mean(records, steps=800) == (80 * 9.0 + 80 * 1.0) / 160  # steps 205-1000


def test_runs_with_the_same_batches_correlate_and_others_do_not():
    steps = range(5, 1001, 5)
    batch = {step: math.sin(step * 1.7) for step in steps}  # each step's batch difficulty
    a = {step: 4.0 + batch[step] for step in steps}
    b = {step: 4.1 + batch[step] for step in steps}  # another arm, same seed: shifted, same batches
    c = {step: 4.0 + math.cos(step * 0.9) for step in steps}
    assert noise.correlation(a, b) > 0.999
    assert abs(noise.correlation(a, c)) < 0.3


def test_a_pair_is_the_arms_window_and_final_over_the_peers():
    peer = {step: 4.0 for step in range(5, 1001, 5)}
    arm = {step: (4.4 if step > 950 else 4.04) for step in range(5, 1001, 5)}  # the last ten records: 4.4
    window, final = noise.relative(arm, peer)
    assert math.isclose(window, (70 * 4.04 + 10 * 4.4) / 80 / 4.0 - 1)
    assert math.isclose(final, 0.1)


def test_a_sibling_folder_names_its_rule_and_seed():
    assert noise.sibling_of("sibling-lamb-eager-s2") == ("lamb", 2)
    assert noise.sibling_of("sibling-onebit_lamb-eager-s1") == ("default", 1)


def test_each_run_again_keeps_its_own_row():
    labels = {noise.again_label(rule, seed) for rule, seed in [("default", 1), ("default", 3), ("lamb", 1)]}
    assert len(labels) == 3
    assert noise.again_label("default", 3) == "default sim32 s3 run again"
    assert len({noise.again_label(rule, seed) for rule, seed in noise.AGAIN.values()}) == len(noise.AGAIN)


def test_one_runs_spread_is_its_sibling_pairs_root_mean_square_over_root_two():
    # two pairs of realizations, each pair's difference the sum of two runs' independent noise
    assert math.isclose(noise.realization_spread([0.02, -0.02]), 0.02 / math.sqrt(2))
    assert math.isclose(noise.realization_spread([0.03, 0.0, 0.04]), math.sqrt((9 + 16) / 3 / 2) / 100)


def test_the_chance_of_pairs_agreeing_is_the_chi_square_of_their_spread_on_the_noise():
    values = [0.0097, 0.0173, 0.0168]
    sigma = 0.0082
    # two degrees of freedom: cdf(x) = 1 - exp(-x / 2) at x = 2 s^2 / sigma^2
    expected = 1 - math.exp(-statistics.variance(values) / sigma**2)
    assert math.isclose(noise.spread_chance(values, sigma), expected)
    assert noise.spread_chance([0.01, 0.01, 0.01], sigma) == 0.0  # pairs that agree exactly
    assert noise.spread_chance([0.0, 0.05, -0.05], sigma) > 0.99  # pairs far wider than the noise
