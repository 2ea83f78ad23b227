"""The emulated-Ethernet harness (launch/netns.sh + launch/netns.py) and a 2-rank, few-second variant of
`bench net`'s allreduce measurement. Needs root and network namespaces; skipped with the reason otherwise."""

from __future__ import annotations

import os
import subprocess

import pytest

from launch.netns import SCRIPT, EmulatedNetwork, rank_namespace, unavailable_reason

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(REASON is not None, reason=f"emulated network unavailable: {REASON}"),
]


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _host_state() -> tuple[str, str, str]:
    """The host namespace's links (names only), qdiscs and routes: the harness must never change them."""

    def run(*command: str) -> str:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout

    links = sorted(line.split(":")[1].strip().split("@")[0] for line in run("ip", "-o", "link").splitlines())
    qdiscs = sorted(line.split(" refcnt")[0] for line in run("tc", "qdisc", "show").splitlines())
    return "\n".join(links), "\n".join(qdiscs), run("ip", "route")


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("injected failure on rank 1")
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # rank 0 waits for rank 1 until the harness stops it
    return rank


def _address_and_sum(rank: int, world_size: int) -> tuple[str, float]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    address = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", "nx0"], capture_output=True, text=True)
    return address.stdout.split()[3], float(value)


def test_sets_up_runs_and_tears_down_cleanly():
    host_before = _host_state()
    with EmulatedNetwork(world_size=2, rate="1gbit") as network:
        names = set(network.namespaces())
        assert names <= _netns_names()
        for namespace in network.namespaces():
            qdisc = subprocess.run(
                ["tc", "-n", namespace, "qdisc", "show", "dev", "nx0"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "tbf" in qdisc and "1Gbit" in qdisc
        results = network.run(_address_and_sum)
        assert results == [("10.77.0.1/24", 3.0), ("10.77.0.2/24", 3.0)]
        network.set_rate("none")
        qdisc = subprocess.run(
            ["tc", "-n", network.namespaces()[0], "qdisc", "show", "dev", "nx0"],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" not in qdisc
        counters = network.counters()
        assert all(c["tx_bytes"] > 0 and c["rx_bytes"] > 0 for c in counters)
        assert _host_state() == host_before, "the harness changed the host's links, qdiscs or routes"
    assert not names & _netns_names(), "namespaces left behind"
    assert _host_state() == host_before


@pytest.mark.slow
def test_a_failing_rank_fails_the_call_and_everything_is_removed():
    with (
        pytest.raises(RuntimeError, match="injected failure on rank 1"),
        EmulatedNetwork(2, "none") as network,
    ):
        names = set(network.namespaces())
        network.run(_fail_on_rank_one, timeout=120)
    assert not names & _netns_names()


def test_cleanup_removes_networks_of_dead_owners_only():
    dead_owner = _a_dead_pid()
    stale_id, live_id = f"{dead_owner}-stale", f"{os.getpid()}-live"
    try:
        for run_id in (stale_id, live_id):
            subprocess.run([str(SCRIPT), "up", "--id", run_id, "--ranks", "1", "--rate", "none"], check=True)
        out = subprocess.run([str(SCRIPT), "cleanup"], capture_output=True, text=True, check=True).stdout
        names = _netns_names()
        assert rank_namespace(stale_id, 0) not in names, out
        assert rank_namespace(live_id, 0) in names, out
    finally:
        for run_id in (stale_id, live_id):
            subprocess.run([str(SCRIPT), "down", "--id", run_id], check=True)
    assert not any(
        name.startswith(f"bln-{dead_owner}-") or name.startswith(f"bln-{live_id}") for name in _netns_names()
    )


def _a_dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_script_rejects_bad_input_with_one_line():
    bad_rate = subprocess.run(
        [str(SCRIPT), "up", "--id", f"{os.getpid()}-bad", "--ranks", "1", "--rate", "fast"],
        capture_output=True,
        text=True,
    )
    subprocess.run([str(SCRIPT), "down", "--id", f"{os.getpid()}-bad"], check=True)
    assert bad_rate.returncode != 0 and "rate 'fast'" in bad_rate.stderr
    bad_id = subprocess.run(
        [str(SCRIPT), "up", "--id", "x y", "--ranks", "1"], capture_output=True, text=True
    )
    assert bad_id.returncode == 2 and "--id" in bad_id.stderr


@pytest.mark.slow
def test_quick_allreduce_measurement_is_rate_limited_and_counts_bytes(tmp_path):
    from bench.net import _allreduce_records

    numel = 4_000_000
    records = {
        r.name: r for r in _allreduce_records("quick", numel, 2, ["none", "1gbit"], repeats=1, quick=True)
    }
    limited = records["allreduce_seconds_compressed_vs_fp32_quick_n2_1gbit"].config["operations"]
    free = records["allreduce_seconds_compressed_vs_fp32_quick_n2_none"].config["operations"]
    fp32 = limited["fp32"]
    # The ring sends 2(n-1)/n x 16 MB = 16 MB per rank; the link cannot carry it faster than 1 Gbit/s.
    assert fp32["model_bytes_per_rank"] == pytest.approx(16_000_000, rel=0.01)
    assert fp32["seconds_median"] >= 0.9 * fp32["model_bytes_per_rank"] * 8 / 1e9
    assert fp32["seconds_median"] > free["fp32"]["seconds_median"]
    # tc counts the payload plus every segment's headers (a few %), the interface counts GSO packets once.
    assert 1.0 <= fp32["qdisc_sent_bytes_per_rank"] / fp32["model_bytes_per_rank"] < 1.15
    assert 0.99 <= fp32["tx_bytes_per_rank"] / fp32["model_bytes_per_rank"] < 1.1
    wire = records["wire_bytes_compressed_vs_fp32_quick_n2_1gbit"]
    assert wire.config["counter_ratio"] == pytest.approx(1 / 32, rel=0.01)
    assert 1 / 40 < wire.ratio < 1 / 25  # measured on the wire, headers included
    assert limited["compressed"]["model_bytes_per_rank"] == pytest.approx(numel / 8, rel=0.01)
    # the torch-kernels peer of the fused passes ran in the same processes and sent the same bytes
    compressed_bytes = limited["compressed"]["model_bytes_per_rank"]
    assert limited["compressed_torch"]["model_bytes_per_rank"] == compressed_bytes
    assert limited["compressed_unpipelined"]["model_bytes_per_rank"] == compressed_bytes
    for peer in ("torch_kernels", "unpipelined"):
        assert records[f"allreduce_seconds_compressed_vs_{peer}_quick_n2_1gbit"].peer_value > 0
    # the default layout's exchange (BERT-mini's), fused and with its passes separate: the same bytes, more
    # than DeepSpeed's single scale (its ~30K scales ride along)
    fused, separate = limited["compressed_default"], limited["compressed_default_separate"]
    assert fused["model_bytes_per_rank"] == separate["model_bytes_per_rank"]
    against = records["allreduce_seconds_compressed_default_vs_separate_passes_quick_n2_1gbit"]
    assert against.peer_value > 0 and against.value > 0
    default_numel = against.config["numel_padded_default"]
    assert 10_000_000 < default_numel < 12_000_000
    per_element = fused["model_bytes_per_rank"] / default_numel
    assert 1 < per_element / (compressed_bytes / against.config["numel_padded"]) < 1.2
    assert "allreduce_seconds_compressed_default_vs_fp32_quick_n2_1gbit" in records


@pytest.mark.slow
def test_quick_e2e_without_kept_host_memory_leaves_malloc_alone_on_every_rank(tmp_path):
    """`bench net --part=e2e --no-keep-host-memory`: every variant's trainer runs with keep_host_memory=false
    (glibc left as it is on each rank: the faulting reference), and the records go to a file of their own."""
    import json

    import bench.net

    bench.net.main(["--part=e2e", "--quick", "--no-keep-host-memory", f"--out={tmp_path}"])
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["net_e2e_no_keep_host_memory_quick.json"]
    records = json.loads((tmp_path / "net_e2e_no_keep_host_memory_quick.json").read_text())
    config = records[0]["config"]
    assert config["keep_host_memory"] is False and config["host_memory_kept_per_rank"] == [False, False]
    assert config["variants"]["onebit_lamb"]["stage"] == "compression"
    assert all(variant["samples_per_s"] > 0 for variant in config["variants"].values())
