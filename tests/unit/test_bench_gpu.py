"""`python -m bench gpu` (`make gpu-check`, the package bench/gpu/): its arithmetic, its exit on a machine
without CUDA, and every check's code path at toy sizes on the CPU (`--cpu-smoke`); on a GPU machine
`make gpu-check` runs it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import gpu
from bench.gpu import arms as gpu_arms
from bench.gpu import gpu_tests
from bench.gpu import profile as gpu_profile


def test_training_flops_of_bert_large_at_seq_128():
    # by hand: 24 layers x (8·1024² + 4·1024·4096 + 4·128·1024) per token, 128 tokens; MLM head on 20
    # masked tokens 2·(1024² + 1024·30522) each; pooler 2·1024², NSP 4·1024; times 3 (forward + backward)
    per_token = 24 * (8 * 1024**2 + 4 * 1024 * 4096 + 4 * 128 * 1024)
    forward = 128 * per_token + 20 * 2 * (1024**2 + 1024 * 30522) + 2 * 1024**2 + 4 * 1024
    assert gpu.training_flops(128, 20) == 3 * forward
    # NVIDIA's 580 samples/s on an A100 (312 TFLOP/s) is 45 % MFU under this formula
    assert 580 * gpu.training_flops(128, 20) / 312e12 == pytest.approx(0.448, abs=0.002)


def test_peak_tflops_by_device_name():
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu.peak_tflops("NVIDIA H200") == 989.0
    assert gpu.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu.peak_tflops("Some Future GPU") is None


def test_without_cuda_it_says_so_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu.main([f"--out={tmp_path}"])
    assert "no CUDA device" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_unknown_step_is_refused():
    with pytest.raises(SystemExit, match="unknown --steps"):
        gpu.main(["--cpu-smoke", "--steps=packer,bogus"])


@pytest.mark.slow  # torch.compile of the comm kernels
def test_packer_and_allreduce_checks_pass_on_the_cpu(tmp_path):
    gpu.main(["--cpu-smoke", "--steps=packer,allreduce", f"--out={tmp_path}"])
    records = {r["name"]: r for r in json.loads((tmp_path / "gpu_smoke.json").read_text())}
    assert records["packer_cases_differing"]["value"] == 0
    assert records["packer_cases_differing"]["config"]["cases"] == 2 * len(gpu.packer_lengths(smoke=True))
    for n in (8, 64):
        for exchange in ("deepspeed", "default"):
            record = records[f"allreduce_n{n}_{exchange}_vs_reference"]
            assert record["value"] == 0.0 and record["config"]["bitwise_equal_calls"] == 3
            assert record["config"]["relative_l2"] == 0.0
        assert records[f"allreduce_n{n}_single_per_worker"]["ratio"] > 0
    # the compiled kernels (Inductor's C++ here, Triton on a GPU) against the torch kernels, in the same run
    for exchange in ("deepspeed", "default"):
        record = records[f"allreduce_n8_{exchange}_compiled_vs_torch_kernels"]
        assert record["value"] == 0.0 and record["config"]["compiled_vs_reference"]["off_fraction"] == 0.0
    assert records["allreduce_n8_single_per_worker_compiled"]["ratio"] > 0
    assert "allreduce_n64_single_per_worker_compiled" not in records


@pytest.mark.slow
def test_compiled_kernels_that_fail_leave_the_torch_kernels_figures(tmp_path, monkeypatch):
    """A GPU where Triton cannot build the compiled kernels: the check says so and fails, and the torch
    kernels' records of the same check are still written."""
    from pretrain.comm import compiled_kernels

    def broken(self, *args, **kwargs):
        raise RuntimeError("triton: no kernel for this GPU")

    monkeypatch.setattr(compiled_kernels.CompiledKernels, "compress_", broken)
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--cpu-smoke", "--steps=allreduce", f"--out={tmp_path}"])
    assert exit_info.value.code == 1
    records = {r["name"]: r for r in json.loads((tmp_path / "gpu_smoke.json").read_text())}
    assert records["allreduce_n8_default_vs_reference"]["value"] == 0.0
    assert records["allreduce_n8_single_per_worker"]["value"] > 0
    assert "allreduce_n8_default_compiled_vs_torch_kernels" not in records
    assert math.isnan(records["allreduce_n8_single_per_worker_compiled"]["value"])


def test_a_wrong_packer_fails_the_check(tmp_path, monkeypatch):
    """The check compares bytes for real: a packer that flips one bit is caught and the exit status is 1."""
    from pretrain.comm import packing

    original = packing.TorchSignPacker.pack

    def flipped(self, values, *, out=None):
        packed = original(self, values, out=out)
        packed[0] ^= 1
        return packed

    monkeypatch.setattr(packing.TorchSignPacker, "pack", flipped)
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--cpu-smoke", "--steps=packer", f"--out={tmp_path}"])
    assert exit_info.value.code == 1
    records = json.loads((tmp_path / "gpu_smoke.json").read_text())
    assert records[0]["name"] == "packer_cases_differing" and records[0]["value"] > 0


@pytest.mark.slow
def test_optim_throughput_and_profile_checks_run_on_the_cpu(tmp_path):
    gpu.main(["--cpu-smoke", "--steps=optim,throughput,profile", f"--out={tmp_path}"])
    records = {r["name"]: r for r in json.loads((tmp_path / "gpu_smoke.json").read_text())}
    for name in ("lamb_eager_step", "lamb_compiled_step", "onebit_lamb_compiled_compression_step"):
        assert records[name]["peer"] == "torch.optim.AdamW(fused=True)" and records[name]["ratio"] > 0
    assert records["toy_seq32_compiled_samples_per_s"]["value"] > 0
    # every profile arm ran, the compiled ones with their kernel classes; the baselines are throughput's
    for mode, arms in gpu_profile.PROFILE_ARMS.items():
        for arm in arms:
            record = records[f"profile_seq32_{mode}_{arm}_samples_per_s"]
            assert record["value"] > 0 and record["peer_value"] > 0
            assert mode == "eager" or arm == "baseline" or "kernel_seconds_per_step" in record["config"]
    assert records["profile_seq32_compiled_baseline_samples_per_s"]["config"]["from"] == "throughput"
    assert records["profile_seq32_compiled_layers4_samples_per_s"]["config"]["host_syncs"] == 0
    assert "seq 32 compiled layers4" in (tmp_path / "gpu_smoke_kernels.txt").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a compile per arm and per bin
def test_the_step_arms_run_on_the_cpu(tmp_path):
    """The arms as the trainer runs them, at toy sizes: the combination (padded vocabulary, static gradient
    buffers; no CUDA graphs on the CPU), length bins beside the same step unbinned on the same length mix,
    and float8 reported as not run (no CUDA here). `make gpu-check ARGS=--cpu-smoke` runs the default arms
    after throughput; every arm's code is the same at any size."""
    arms = "seq128_micro256_pad64_graphs,seq512_micro64_pad64_bins4,seq128_micro256_pad64_float8"
    gpu.main(["--cpu-smoke", "--steps=arms", f"--arms={arms}", f"--out={tmp_path}"])
    records = {r["name"]: r for r in json.loads((tmp_path / "gpu_smoke.json").read_text())}
    graphs = records["toy_arm_seq128_micro256_pad64_graphs_samples_per_s"]
    assert graphs["value"] > 0 and graphs["config"]["static_gradients"]
    assert not graphs["config"]["cuda_graphs"]  # the CPU: the static-buffer path without replays
    assert graphs["config"]["pad_vocab_multiple"] == 64 and graphs["config"]["micro_batch"] == 8
    assert "kernel_seconds_per_step" in graphs["config"]
    binned = records["toy_arm_seq512_micro64_pad64_bins4_samples_per_s"]
    assert binned["value"] > 0 and binned["peer_value"] > 0  # the unbinned step on the same samples
    assert binned["config"]["length_bins"] == [16, 32, 48, 64] and binned["config"]["padding_share"] > 0.3
    assert min(binned["config"]["binned_widths"]) < 64 == max(binned["config"]["binned_widths"])
    assert "float8" in records["arms_not_run"]["config"]["arms"][0]
    assert "arm seq128_micro256_pad64_graphs" in (tmp_path / "gpu_smoke_kernels.txt").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1200)  # pretrain, resume and fine-tune in subprocesses
def test_the_tests_step_runs_make_test_gpu_and_the_pipeline_on_the_cpu(tmp_path, tiny_data, monkeypatch):
    """`make test-gpu` inside the device script: under --cpu-smoke the pipeline test (pretrain through the
    1-bit stage, resume, fine-tune) runs on the CPU and its stage seconds become records."""
    monkeypatch.setenv("GPU_CHECK_DATA", str(tiny_data))
    gpu.main(["--cpu-smoke", "--steps=tests", f"--out={tmp_path}"])
    records = {r["name"]: r for r in json.loads((tmp_path / "gpu_smoke.json").read_text())}
    assert records["test_gpu_failed"]["value"] == 0 and records["test_gpu_passed"]["value"] >= 1
    tests = records["test_gpu_passed"]["config"]["tests"]
    (pipeline,) = [t for name, t in tests.items() if "test_pipeline" in name]
    assert pipeline["outcome"] == "passed"
    assert pipeline["properties"]["pretrain_to_step_20_comm_kernels"] == "numba"  # the CPU's default
    for stage in ("pretrain_to_step_20", "resume_to_step_30", "finetune_mrpc"):
        assert records[f"pipeline_{stage}"]["value"] > 0
    # the CUDA-only tests skipped with their reason
    assert any(t["outcome"] == "skipped" and "CUDA" in t.get("reason", "") for t in tests.values())


def test_junit_results_are_read_with_counts_and_properties(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_pipeline" name="test_a" time="3.21">'
        '<properties><property name="pretrain_s" value="2.5"/></properties></testcase>'
        '<testcase classname="t" name="test_b" time="0.1"><skipped message="needs 2 GPUs"/></testcase>'
        '<testcase classname="t" name="test_c" time="0.2"><failure message="boom&#10;more"/></testcase>'
        "</testsuite></testsuites>"
    )
    result = gpu_tests.read_junit(path)
    assert result["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert result["tests"]["tests.gpu.test_pipeline::test_a"]["properties"] == {"pretrain_s": "2.5"}
    assert result["tests"]["t::test_b"]["reason"] == "needs 2 GPUs"
    assert result["tests"]["t::test_c"]["reason"] == "boom"


def test_the_tests_step_collects_every_file_with_gpu_tests(repo_root):
    files = gpu_tests.gpu_test_files(repo_root / "tests")
    assert {"tests/gpu/test_pipeline.py", "tests/gpu/test_nccl.py", "tests/unit/test_comm_kernels.py"} <= set(
        files
    )
    assert "tests/unit/test_bench_gpu.py" not in files


def test_arms_are_selected_by_name():
    assert [a.name for a in gpu_arms.selected_arms("default")] == [
        "seq128_micro256_pad64_graphs",
        "seq512_micro64_pad64_bins2",
    ]
    assert len(gpu_arms.selected_arms("all")) > len(gpu_arms.DEFAULT_ARMS)
    assert [a.micro for a in gpu_arms.selected_arms("seq128_micro128,seq512_micro32")] == [128, 32]
    with pytest.raises(SystemExit, match="unknown --arms"):
        gpu_arms.selected_arms("seq128_micro1000")


def test_ddp_buffer_keyword_matches_the_installed_torch(monkeypatch):
    """torch 2.13 names it forward_sync_buffers, earlier releases broadcast_buffers (the GPU check's first
    run died on torch 2.11 refusing the new name)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    from pretrain.distributed import process_group as distributed

    (keyword,) = distributed.no_buffer_sync()
    assert keyword in inspect.signature(DistributedDataParallel.__init__).parameters

    class OldDDP:
        def __init__(self, module, device_ids=None, broadcast_buffers=True):
            pass

    monkeypatch.setattr(distributed, "DistributedDataParallel", OldDDP)
    assert distributed.no_buffer_sync() == {"broadcast_buffers": False}


def test_a_profile_arm_that_fails_leaves_the_other_arms(tmp_path, monkeypatch):
    """One profile arm's error (CUDA graphs on an H200) must not lose the other arms' figures: each arm
    fails on its own: reported, exit status 1, the others' records written."""
    from pretrain import model as model_module

    def broken(model):
        raise RuntimeError("planted: this arm cannot run here")

    monkeypatch.setattr(model_module, "column_major_linear_weights_", broken)
    arms = {"eager": ("baseline", "column_major", "no_mask"), "compiled": ()}
    monkeypatch.setattr(gpu_profile, "PROFILE_ARMS", arms)
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--cpu-smoke", "--steps=profile", f"--out={tmp_path}"])
    assert exit_info.value.code == 1
    records = {r["name"]: r for r in json.loads((tmp_path / "gpu_smoke.json").read_text())}
    assert "profile_seq32_eager_column_major_samples_per_s" not in records
    assert records["profile_seq32_eager_no_mask_samples_per_s"]["peer_value"] > 0
    assert records["profile_seq32_eager_baseline_samples_per_s"]["value"] > 0
