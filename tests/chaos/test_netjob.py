"""The soak and the netjob it starts name the same network namespaces (fast tier, no root needed).

The soak takes a link down in the hub namespace of the netjob it started (`netjob.link`); the netjob's
`launch/netns.sh up` names it from NETNS_PREFIX in the environment the soak passes on. The prefix was read
once, when the soak imported netjob, with a default of its own, and `python -m tests.chaos` set
NETNS_PREFIX only after that import: where it was unset, the soak's `ip -n <prefix>-<id>-hub` named a
namespace that did not exist, and every `make chaos` soak crashed at its first link fault."""

from __future__ import annotations

from tests.chaos import netjob


def test_the_prefix_is_read_when_it_is_used(monkeypatch):
    monkeypatch.setenv("NETNS_PREFIX", "chaost")  # as the slow-tier soak test sets it, after the import
    assert netjob.hub("12-c3") == "chaost-12-c3-hub"
    monkeypatch.delenv("NETNS_PREFIX")
    assert netjob.hub("12-c3") == f"{netjob.DEFAULT_PREFIX}-12-c3-hub"


def test_a_failed_link_command_is_a_problem_of_the_soak_not_a_crash(tmp_path, monkeypatch):
    import subprocess

    from tests.chaos.soak import Soak

    def failing(run_id: str, rank: int, up: bool) -> None:
        raise subprocess.CalledProcessError(2, ["ip", "-n", netjob.hub(run_id), "link", "set", f"r{rank}"])

    monkeypatch.setattr(netjob, "link", failing)
    soak = Soak(tmp_path, tmp_path, seed=1, faults=1, say=lambda *_: None)
    soak.net_id = "1-c1"
    assert soak._link(1, up=False) is False
    soak.link_up_at = (0.0, 1)
    soak._end_faults()  # the launch's end puts the cable back: it fails too, and says so once per kind
    assert soak.link_up_at is None
    assert [p.split(" failed")[0] for p in soak.problems] == ["link down for rank 1", "link up for rank 1"]
