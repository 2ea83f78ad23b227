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
