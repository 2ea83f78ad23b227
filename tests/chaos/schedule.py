"""The chaos soak's fault schedule: a pure function of (seed, number of faults, fault kinds).

A schedule is a list of `ChaosFault`s in the order they strike one pretraining run. Each fault says what
happens (`kind`), where in a step (`point`, one of the fault points of pretrain/distributed/faults.py, or
`startup` for a kill while the job is still starting), to which rank, and when: the global step
`target`. Targets spread the faults over the whole run (fault i near step i x total / count, some moved
onto the recipe's boundaries: freeze_step, the first compression step, the last step of phase 1, the first
of phase 2). The soak (tests/chaos/soak.py) arms a fault at its target, or, when the run already stands
there (a fault struck again and again at one step), at the first step after the one it resumes from: a
fault right after a resume.

Kinds (`KINDS`):
    kill     SIGKILL one rank (faults.py `kill`): the survivor exits 76 with one line naming the rank
    stall    SIGSTOP one rank at the point (faults.py `hold`, then the harness stops it); the survivor
             times out after dist.timeout_s and exits 76 naming it; the stall ends once it is named
    term     SIGTERM to one rank (faults.py `term`, preemption): checkpoint, every rank exits 75
    disk     the run's tmpfs is filled just before a checkpoint save: one line, exit 2; freed after
             `hold_s`, while the supervisor waits for the space, which then relaunches
    link     the link between the ranks goes down for `hold_s` (the netns harness, `ip link set down`,
             then up): short outages (< dist.timeout_s / 2) are ridden out, long ones (> dist.timeout_s)
             end in exit 76
    flip     one byte of the shard the next step reads is flipped: one line naming the shard, exit 2; the
             byte is restored before the relaunch
    restart  SIGKILL one rank `hold_s` after the launch started (while the job is still starting up)
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

KINDS = ("kill", "stall", "term", "disk", "link", "flip", "restart")
# the order of the points inside one step (the exchange runs in the optimizer step, after mid_step)
POINT_ORDER = ("grad_allreduce", "mid_step", "exchange", "after_step", "checkpoint_write", "after_checkpoint")
# points a kind strikes at; the collective ones (grad_allreduce, exchange) are mapped to the collective the
# step really runs (`Recipe.collective_point`)
KIND_POINTS = {
    "kill": POINT_ORDER,
    "stall": POINT_ORDER,
    "term": POINT_ORDER,
    "disk": ("after_step",),  # before the save of the step
    "link": POINT_ORDER,
    "flip": ("after_step", "after_checkpoint"),
    "restart": ("startup",),
}
WEIGHTS = {"kill": 4, "stall": 2, "term": 3, "disk": 2, "link": 3, "flip": 2, "restart": 1}


@dataclass(frozen=True)
class Recipe:
    """The soak's pretraining run: the demo recipe shortened (tests/reliability's CI plan): 16 + 4 steps,
    freeze_step 6, both phases, a checkpoint after every step."""

    phase1_steps: int = 16
    phase2_steps: int = 4
    freeze_step: int = 6
    overrides: tuple[str, ...] = (
        "batch.phases.0.steps=16",
        "batch.phases.0.freeze_step=6",
        "batch.phases.0.schedule.warmup_steps=4",
        "batch.phases.1.steps=4",
        "batch.phases.1.schedule.warmup_steps=1",
    )

    @property
    def total_steps(self) -> int:
        return self.phase1_steps + self.phase2_steps

    @property
    def boundaries(self) -> tuple[int, ...]:
        f, p = self.freeze_step, self.phase1_steps
        return (f, f + 1, p, p + 1)

    def collective_point(self, optim: str, step: int) -> str:
        """The collective a fault 'inside the collective' of `step` can strike: DDP's gradient allreduce
        (LAMB; 1-bit LAMB's warmup stage) or the 1-bit exchange (1-bit LAMB's compression stage)."""
        return "exchange" if optim.startswith("onebit") and step > self.freeze_step else "grad_allreduce"


# the demo recipe as it is (40 + 10 steps, freeze_step 12): `make chaos`'s, where 50 faults fit (on the
# short one, the run gets to its end after about 40: SIGTERMs, flips and short outages move it on)
SHORT = Recipe()
DEMO = Recipe(phase1_steps=40, phase2_steps=10, freeze_step=12, overrides=())
RECIPES = {"short": SHORT, "demo": DEMO}


@dataclass(frozen=True)
class ChaosFault:
    index: int
    kind: str
    point: str
    rank: int
    target: int  # the global step to strike (or the first one after the resume, when the run is past it)
    boundary: bool  # the target was moved onto a recipe boundary
    hold_s: float  # link: outage; stall: extra seconds stopped after it is named; disk: until freed;
    # restart: seconds after the launch

    def as_dict(self) -> dict:
        return asdict(self)


def link_seconds(timeout_s: float, long: bool, rng: random.Random) -> float:
    """A short outage stays well under the liveness warning (timeout/2); a long one well past the timeout."""
    if long:
        return round(rng.uniform(timeout_s + 4, timeout_s + 8), 1)
    return round(rng.uniform(1.0, max(1.5, timeout_s / 2 - 3)), 1)


def make_schedule(
    seed: int,
    count: int,
    kinds: tuple[str, ...] = KINDS,
    recipe: Recipe | None = None,
    timeout_s: float = 20.0,
    world_size: int = 2,
) -> list[ChaosFault]:
    """`count` faults drawn from `kinds` with `random.Random(seed)` only: the same arguments give the
    same schedule, in any process."""
    recipe = recipe or SHORT
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"chaos kinds: {sorted(unknown) or 'none'} not in {KINDS}")
    rng = random.Random(f"chaos-schedule/{seed}")
    pool = [kind for kind in KINDS if kind in kinds]
    weights = [WEIGHTS[kind] for kind in pool]
    total = recipe.total_steps
    # every kind at least once when there are enough faults, the rest by weight, in a random order
    drawn = list(pool) if count >= len(pool) else []
    drawn += rng.choices(pool, weights, k=count - len(drawn))
    rng.shuffle(drawn)
    faults = []
    for index, kind in enumerate(drawn):
        point = rng.choice(KIND_POINTS[kind])
        rank = rng.randrange(world_size)
        target = 1 + index * (total - 1) // max(count, 1) + rng.choice((-1, 0, 0, 1))
        boundary = rng.random() < 0.2
        if boundary:
            target = min(recipe.boundaries, key=lambda b: (abs(b - target), b))
        target = max(1, min(total, target))
        if kind == "link":
            hold = link_seconds(timeout_s, long=rng.random() < 0.4, rng=rng)
        elif kind == "restart":
            hold = round(rng.uniform(0.5, 6.0), 1)
        else:
            hold = round(rng.uniform(0.2, 3.0), 1)
        faults.append(ChaosFault(index, kind, point, rank, target, boundary, hold))
    return faults
