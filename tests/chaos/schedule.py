"""The chaos soak's fault schedule: a pure function of (seed, number of faults, fault kinds).

A schedule is a list of `ChaosFault`s in the order they strike one pretraining run. Each fault says what
happens (`kind`), where in a step (`point`, one of the fault points of pretrain/distributed/faults.py, or
`startup` for a kill while the job is still starting), to which rank, and when: the global step
`target`. Targets spread the faults over the whole run (fault i near step i x total / count; about half
of those within 2 steps of one of the recipe's boundaries are moved onto it: freeze_step, the first
compression step, the last step of phase 1, the first of phase 2). The soak (tests/chaos/soak.py) arms a
fault at its target, or, when the run already stands there (a fault struck again and again at one step),
at the first step after the one it resumes from: a fault right after a resume.

A run holds only so many faults that move it on (a SIGTERM checkpoints and exits, a flipped byte is found
by the next step, a short link outage is ridden out, a kill after a checkpoint: each moves the run on by a
step), so a fixed list of `count` faults can find the run at its end before the last ones strike. The
`Planner` arms the faults launch by launch: a fault that would let the run finish (a SIGTERM or a short
outage at the last step) waits until it is the last one needed, and while no fault of the list can strike
without ending the run, it draws further ones from the same seeded RNG (`make_schedule(extra=...)`: the
reserve, struck at the first step after the resume) until `count` have struck. The soak reports what was
drawn and what found no step.

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
from dataclasses import asdict, dataclass, field

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


# the demo recipe as it is (40 + 10 steps, freeze_step 12): `make chaos`'s, where the 50 faults of a
# schedule fit (on the short one the run reaches its last steps after about 40: SIGTERMs, flips and short
# outages move it on, and the Planner draws from the reserve)
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
    reserve: bool = (
        False  # drawn after the `count` faults of the schedule, to replace ones that found no step
    )

    def as_dict(self) -> dict:
        return asdict(self)


def link_seconds(timeout_s: float, long: bool, rng: random.Random) -> float:
    """A short outage stays well under the liveness warning (timeout/2); a long one well past the timeout."""
    if long:
        return round(rng.uniform(timeout_s + 4, timeout_s + 8), 1)
    return round(rng.uniform(1.0, max(1.5, timeout_s / 2 - 3)), 1)


# a target within this many steps of a recipe boundary may be moved onto it (a far one would move the run
# on by many steps in one launch: an early fault moved onto freeze_step trains the steps before it)
BOUNDARY_REACH = 2


def make_schedule(
    seed: int,
    count: int,
    kinds: tuple[str, ...] = KINDS,
    recipe: Recipe | None = None,
    timeout_s: float = 20.0,
    world_size: int = 2,
    extra: int = 0,
) -> list[ChaosFault]:
    """`count` faults drawn from `kinds` with `random.Random(seed)` only, then `extra` reserve faults drawn
    after them from the same RNG (target 1: the first step after the resume): the same arguments give the
    same schedule, in any process, and the first `count` do not depend on `extra`."""
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
        spot = 1 + index * (total - 1) // max(count, 1)
        faults.append(_draw(rng, index, kind, spot, recipe, timeout_s, world_size))
    for index in range(count, count + extra):
        kind = rng.choices(pool, weights)[0]
        faults.append(_draw(rng, index, kind, None, recipe, timeout_s, world_size))
    return faults


def _draw(
    rng: random.Random, index: int, kind: str, spot: int | None, recipe: Recipe, timeout_s: float,
    world_size: int,
) -> ChaosFault:  # fmt: skip
    """One fault near step `spot` (None: a reserve fault, target 1)."""
    point = rng.choice(KIND_POINTS[kind])
    rank = rng.randrange(world_size)
    jitter = rng.choice((-1, 0, 0, 1))
    target = 1 if spot is None else spot + jitter
    snap = rng.random() < 0.5
    near = [b for b in recipe.boundaries if abs(b - target) <= BOUNDARY_REACH]
    boundary = snap and bool(near) and spot is not None
    if boundary:
        target = min(near, key=lambda b: (abs(b - target), b))
    target = max(1, min(recipe.total_steps, target))
    if kind == "link":
        hold = link_seconds(timeout_s, long=rng.random() < 0.4, rng=rng)
    elif kind == "restart":
        hold = round(rng.uniform(0.5, 6.0), 1)
    else:
        hold = round(rng.uniform(0.2, 3.0), 1)
    return ChaosFault(index, kind, point, rank, target, boundary, hold, reserve=spot is None)


@dataclass(frozen=True)
class Placement:
    """A fault as one launch carries it: the global step and point it strikes (step None: a restart kill,
    by time after the launch starts)."""

    fault: ChaosFault
    step: int | None
    point: str


def ends_launch(fault: ChaosFault, timeout_s: float) -> bool:
    """Every fault ends its launch but a link outage shorter than dist.timeout_s (ridden out)."""
    return not (fault.kind == "link" and fault.hold_s < timeout_s)


@dataclass
class Planner:
    """Which faults each launch carries, from where the run stands: `count` faults must strike; the
    schedule's first, in order, then the reserve's while none of the schedule's can strike without
    ending the run. A pure function of its arguments and the stands it is given."""

    seed: int
    count: int
    kinds: tuple[str, ...] = KINDS
    recipe: Recipe = SHORT
    optim: str = "onebit_lamb"
    timeout_s: float = 20.0
    world_size: int = 2
    reserve_size: int | None = None  # default: as many as `count`
    queue: list[ChaosFault] = field(init=False)
    reserve: list[ChaosFault] = field(init=False)
    drawn: int = field(init=False)
    placed: int = field(init=False)
    skipped: dict[int, str] = field(init=False)  # fault index -> why it did not strike the last time

    def __post_init__(self) -> None:
        extra = self.count if self.reserve_size is None else self.reserve_size
        faults = make_schedule(
            self.seed, self.count, self.kinds, self.recipe, self.timeout_s, self.world_size, extra=extra
        )
        self.queue, self.reserve = faults[: self.count], faults[self.count :]
        self.drawn, self.placed, self.skipped = self.count, 0, {}

    def resolve(self, fault: ChaosFault, base: int) -> tuple[int, str] | None:
        """The global step and point `fault` strikes when the run stands at `base` (None: nowhere left)."""
        total = self.recipe.total_steps
        step = min(max(fault.target, base + 1), total)
        point = fault.point
        if point in ("grad_allreduce", "exchange"):
            point = self.recipe.collective_point(self.optim, step)
        if fault.kind == "term" and step == total and point in ("checkpoint_write", "after_checkpoint"):
            point = "after_step"  # after the last step's save no step follows to act on the signal
        if fault.kind == "flip" and step >= total:
            step = total - 1  # the flip is found by the next step's read
        if step <= base:
            return None
        if step == total and point in ("checkpoint_write", "after_checkpoint") and fault.kind != "term":
            # struck after the last step's checkpoint is (or may be) complete, the run would be done with
            # faults still to come: strike before that save instead
            point = "mid_step"
        return step, point

    def finishes_run(self, fault: ChaosFault, step: int, point: str) -> bool:
        """Whether `fault` at `step` leaves the last step trained and checkpointed (the run done): a SIGTERM
        at the last step, or during the save of the one before (the signal is acted on after the next step),
        or a short link outage at the last step."""
        total = self.recipe.total_steps
        if fault.kind == "term":
            return step == total or (step == total - 1 and point in ("checkpoint_write", "after_checkpoint"))
        return step == total and not ends_launch(fault, self.timeout_s)

    def arm(self, stand: int) -> list[Placement]:
        """The faults of the next launch, which resumes from checkpoint step `stand`: until one ends the
        launch (a short link outage does not), each at a later step than the one before."""
        armed: list[Placement] = []
        base = stand
        while self.placed < self.count and not (armed and ends_launch(armed[-1].fault, self.timeout_s)):
            placement = self._next(base, later=bool(armed))
            if placement is None:
                break
            armed.append(placement)
            self.placed += 1
            if placement.step is None:  # a restart kill ends the launch
                break
            base = placement.step  # after a fault this launch survives, the next one strikes a later step
        return armed

    def _next(self, base: int, later: bool) -> Placement | None:
        """The first fault of the queue that can strike now (drawing from the reserve while none can)."""
        need = self.count - self.placed
        index = 0
        while True:
            for i in range(index, len(self.queue)):
                placement = self._place(self.queue[i], base, later, last=need == 1)
                if placement is not None:
                    del self.queue[i]
                    self.skipped.pop(placement.fault.index, None)
                    return placement
            if not self.reserve:
                return None
            index = len(self.queue)
            self.queue.append(self.reserve.pop(0))
            self.drawn += 1

    def _place(self, fault: ChaosFault, base: int, later: bool, last: bool) -> Placement | None:
        if fault.kind == "restart":
            # a restart kill strikes while a launch starts: after a fault this launch survives, it waits
            # for the next launch
            if later:
                self.skipped[fault.index] = "a restart kill waits for a launch of its own"
                return None
            return Placement(fault, None, "startup")
        resolved = self.resolve(fault, base)
        if resolved is None:
            self.skipped[fault.index] = f"no step after {base} to strike"
            return None
        step, point = resolved
        if not last and self.finishes_run(fault, step, point):
            # the run ends only once the rest have struck: this one waits while others can strike
            self.skipped[fault.index] = f"at step {step} it would have ended the run with faults to come"
            return None
        return Placement(fault, step, point)

    def left(self) -> list[dict]:
        """The drawn faults that never struck, with the reason the last try gave."""
        return [
            {**fault.as_dict(), "reason": self.skipped.get(fault.index, "not needed: enough struck")}
            for fault in self.queue
        ]
