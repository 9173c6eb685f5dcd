"""The discrete-event loop. It drives the real platform code against one scratch database:

- the clock is a ManualClock that only this loop moves, from event to event, so simulated hours take
  seconds and every timestamp the platform writes is simulated time;
- an arrival goes through the real `admit()`, then puts its tenant on the lane's ring, as the queue
  indexer does for a TaskQueued event;
- a claim comes from the real `Scheduler.tick()` (policy "drr") or from the FIFO baseline, both of
  which end in `aivedio.scheduling.claim.claim`; with the scenario's fresh_scheduler_per_tick (the
  default) every tick gets a new `Scheduler(platform)`, as every call of the tick handler
  (functions/scheduler_tick/handler.py) builds one and `aivedio serve` calls it once per tick, so
  nothing a Scheduler keeps in memory outlives a tick (in AWS one continuous run keeps its Scheduler
  for up to two minutes, and two runs overlap: between the two settings); without it one Scheduler
  serves the whole run;
- capacity is the config's: the lanes' units and the provider accounts' max_concurrency are the
  resource_pool_shard rows the runner created with `aivedio.bootstrap.apply_config`, which the claim
  reserves (lane, account and model keys) and the completion below releases;
- the simulated provider runs each claimed attempt for `units x runtime_per_unit` platform seconds
  (times a jitter drawn from a hash of the task's key, or the scenario's own draw for it, so both
  policies agree): at the claim the task goes DISPATCHING -> RUNNING with started_at, at the end
  RUNNING -> PROVIDER_SUCCEEDED -> SUCCEEDED with finished_at (CAS on state and version), and
  `release_attempt` frees its reservations in the same transaction;
- a release wakes a tick at once (as `platform.wake("scheduler-tick")` does locally); while a lane has
  both queued work and free room, a tick also runs every `scheduler_tick_seconds`, as the real loop;
- the scheduled maintenance (aging, starvation detector, queue-index rebuild) runs every
  `maintenance_seconds`."""
from __future__ import annotations

import heapq
import json
import logging
import time
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from uuid import UUID

from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.auth import Caller
from aivedio.config import ManualClock
from aivedio.errors import DomainError
from aivedio.scheduling.maintenance import age_tasks, detect_starvation
from aivedio.scheduling.resources import release_attempt
from aivedio.scheduling.ring import Ring
from aivedio.scheduling.scheduler import LaneView, Scheduler
from aivedio.tasks import cas_transition
from aivedio_tools.simulate.fifo import FifoPolicy
from aivedio_tools.simulate.scenarios import Arrival, Scenario

log = logging.getLogger("aivedio_tools.simulate")

T0 = datetime(2030, 1, 7, 9, 0, tzinfo=timezone.utc)  # simulated time 0
POLICIES = ("drr", "fifo")

# Event kinds, in the order they are handled within one instant.
COMPLETE, ARRIVE, MAINTAIN, TICK = 0, 1, 2, 3


class SimClock(ManualClock):
    """A ManualClock set to absolute simulated times (platform seconds since T0), so long runs do
    not accumulate rounding."""

    def __init__(self, start: datetime = T0, time_scale: float = 1.0):
        super().__init__(start, time_scale)
        self.start = start
        self.t = 0.0

    def set(self, platform_seconds: float) -> None:
        self.t = platform_seconds
        self._now = self.start + timedelta(seconds=platform_seconds / self.time_scale)
        self._mono = platform_seconds / self.time_scale

    def advance(self, platform_seconds: float) -> None:
        self.set(self.t + platform_seconds)

    def sim_seconds(self, ts: datetime | None) -> float | None:
        return None if ts is None else (ts - self.start).total_seconds() * self.time_scale


def runtime_for(key: str, units: int, per_unit: float, jitter: float, seed: str = "", u: float | None = None) -> float:
    """How long the simulated provider runs a task (platform seconds, to the millisecond). The draw
    u in [0, 1) is the scenario's own for this key where it spreads runtimes evenly, else a hash."""
    if u is None:
        u = zlib.crc32(f"{seed}:{key}".encode()) / 2**32
    return round(units * per_unit * (1 + jitter * (2 * u - 1)), 3)


@dataclass(frozen=True)
class SimTenant:
    tenant_id: UUID
    user_id: UUID
    name: str
    group: str
    weight: int
    service_class: str


@dataclass
class RunStats:
    policy: str
    stop_reason: str = ""
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0
    dispatches: int = 0
    retry_ticks: int = 0
    claims: int = 0
    visits: int = 0
    dispatch_wall_seconds: float = 0.0
    admitted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    maintenance_runs: int = 0
    cas_lost: int = 0
    schedulers_built: int = 0
    runtimes: dict[UUID, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"stop_reason": self.stop_reason, "sim_seconds": round(self.sim_seconds, 3),
                "wall_seconds": round(self.wall_seconds, 2), "dispatches": self.dispatches, "retry_ticks": self.retry_ticks,
                "claims": self.claims, "visits": self.visits, "admitted_during_run": self.admitted,
                "rejected": self.rejected, "maintenance_runs": self.maintenance_runs, "cas_lost": self.cas_lost,
                "schedulers_built": self.schedulers_built,
                "dispatch_wall_seconds": round(self.dispatch_wall_seconds, 2),
                "claims_per_dispatch_wall_second": round(self.claims / self.dispatch_wall_seconds, 1)
                if self.dispatch_wall_seconds else None,
                "ms_per_claim_including_picks": round(1000 * self.dispatch_wall_seconds / self.claims, 3) if self.claims else None}


def _ms(t: float) -> int:
    return int(round(t * 1000))


def admit_arrival(platform, tenant: SimTenant, arrival: Arrival, ring: Ring | None) -> tuple[str, str | None]:
    """Admit one arrival through the real admit(); on success put its tenant on the lane's ring
    (as the queue indexer does on TaskQueued; None: the ring is rebuilt later). Returns (outcome,
    lane): outcome is ACCEPTED/ACCEPTED_BEST_EFFORT or a rejection code."""
    req = GenerationRequest.model_validate(arrival.body)
    try:
        res = admit(platform, Caller(tenant.tenant_id, tenant.user_id, "OWNER"), req, arrival.body, arrival.key)
    except Rejected as r:
        return r.decision, None
    except DomainError as e:
        return getattr(e, "code", type(e).__name__), None
    body = json.loads(res.body)
    if ring is not None:
        ring.add(body["queue_class"], tenant.tenant_id)
    return body["decision"], body["queue_class"]


class Simulation:
    def __init__(self, platform, scenario: Scenario, policy: str, tenants: dict[str, SimTenant],
                 group_totals: dict[str, int], seed: str = ""):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        if not isinstance(platform.clock, SimClock):
            raise TypeError("the simulation needs a SimClock it alone moves")
        self.p, self.sc, self.policy = platform, scenario, policy
        self.clock: SimClock = platform.clock
        self.tenants = tenants
        self.group_of = {t.tenant_id: t.group for t in tenants.values()}
        self.group_left = {g: n for g, n in group_totals.items() if g in scenario.stop_when_done}
        self.ring = Ring(platform)
        self.scheduler: Scheduler | None = None
        self.fifo = FifoPolicy(platform)
        self.seed = seed
        self.heap: list[tuple[int, int, int, object]] = []
        self.seq = 0
        self.running: dict[UUID, tuple[UUID, UUID, int]] = {}  # attempt -> (task, tenant, version)
        self.pending_arrivals = 0
        self.tick_at: int | None = None
        self.stats = RunStats(policy)
        self.tick_seconds = platform.config.timers.scheduler_tick_seconds

    # -- events -------------------------------------------------------------------------------------
    def _push(self, t_ms: int, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t_ms, kind, self.seq, payload))

    def run(self) -> RunStats:
        started = time.monotonic()
        sc = self.sc
        for a in sc.arrivals:
            if a.at > 0:
                self._push(_ms(a.at), ARRIVE, a)
                self.pending_arrivals += 1
        self._push(_ms(sc.maintenance_seconds), MAINTAIN, None)
        self.clock.set(0.0)
        with self.p.db.connection() as conn:
            for lane in sc.lanes:
                self.ring.rebuild(conn, lane)  # the QueueIndexRebuilder: the backlog admitted before t=0
        self._dispatch()
        horizon_ms = _ms(sc.horizon_seconds)
        next_log = 600.0
        while True:
            if self.group_left and all(v <= 0 for v in self.group_left.values()):
                self.stats.stop_reason = f"every task of {', '.join(sorted(self.group_left))} finished"
                break
            if not self.running and not self.pending_arrivals and self.tick_at is None:
                # Nothing will free capacity or bring work: finished, or stuck with work queued.
                self._maintain()
                if self._dispatch() == 0:
                    queued = self._queued()
                    self.stats.stop_reason = (f"stalled: {queued} tasks queued, nothing running, nothing claimable"
                                              if queued else "all work finished")
                    break
                continue
            t_ms = self.heap[0][0]
            if t_ms > horizon_ms:
                self.clock.set(sc.horizon_seconds)
                self.stats.stop_reason = f"horizon {sc.horizon_seconds:.0f} s"
                break
            self.clock.set(t_ms / 1000.0)
            completions, woke = [], False
            while self.heap and self.heap[0][0] == t_ms:
                _, kind, _, payload = heapq.heappop(self.heap)
                if kind == COMPLETE:
                    completions.append(payload)
                elif kind == ARRIVE:
                    if completions:
                        self._complete(completions)
                        completions = []
                    self._arrive(payload)
                    woke = True
                elif kind == MAINTAIN:
                    self._maintain()
                    self._push(t_ms + _ms(sc.maintenance_seconds), MAINTAIN, None)
                    woke = True
                elif kind == TICK:
                    if self.tick_at == t_ms:
                        self.tick_at = None
                        self.stats.retry_ticks += 1
                    woke = True
            if completions:
                self._complete(completions)
                woke = True
            if woke:
                self._dispatch()
            if self.clock.t >= next_log:
                log.info("t=%.0fs policy=%s running=%d claims=%d wall=%.1fs", self.clock.t, self.policy, len(self.running),
                         self.stats.claims, time.monotonic() - started)
                next_log += 600.0
        self.stats.sim_seconds = self.clock.t
        self.stats.wall_seconds = time.monotonic() - started
        return self.stats

    # -- arrivals -----------------------------------------------------------------------------------
    def _arrive(self, a: Arrival) -> None:
        self.pending_arrivals -= 1
        outcome, _ = admit_arrival(self.p, self.tenants[a.tenant], a, self.ring)
        if outcome.startswith("ACCEPTED"):
            self.stats.admitted += 1
        else:
            self.stats.rejected[outcome] = self.stats.rejected.get(outcome, 0) + 1
            group = self.tenants[a.tenant].group
            if group in self.group_left:
                self.group_left[group] -= 1  # a rejected task will never finish

    # -- the scheduler ------------------------------------------------------------------------------
    def _dispatch(self) -> int:
        t0 = time.monotonic()
        if self.policy == "drr":
            r = self._scheduler().tick(budget_seconds=300.0, lanes=self.sc.lanes)
            claims = r.claims
            self.stats.visits += r.visits
        else:
            claims = self.fifo.tick(self.sc.lanes).claims
        self.stats.dispatch_wall_seconds += time.monotonic() - t0
        self.stats.dispatches += 1
        self.stats.claims += claims
        if claims:
            self._start_claimed()
        if self.tick_at is None and self._room_with_work():
            self.tick_at = _ms(self.clock.t + self.tick_seconds)
            self._push(self.tick_at, TICK, None)
        return claims

    def _scheduler(self) -> Scheduler:
        """A new Scheduler for this tick (as the tick handler builds one per call), or the run's one
        Scheduler when the scenario keeps it."""
        if self.scheduler is None or self.sc.fresh_scheduler_per_tick:
            self.scheduler = Scheduler(self.p)
            self.stats.schedulers_built += 1
        return self.scheduler

    def _room_with_work(self) -> bool:
        now = self.clock.now()
        with self.p.db.connection() as conn:
            for lane in self.sc.lanes:
                if not LaneView(self.p, conn, lane).has_room:
                    continue
                row = conn.execute(
                    """select exists(select 1 from generation_task where state = 'QUEUED' and queue_class = %s
                                       and next_eligible_at <= %s) as q""", (lane, now)).fetchone()
                if row["q"]:
                    return True
        return False

    def _queued(self) -> int:
        return self.p.db.fetchone("select count(*) as n from generation_task where state = 'QUEUED'")["n"]

    # -- the simulated provider ---------------------------------------------------------------------
    def _start_claimed(self) -> None:
        """Every attempt claimed this instant starts running now: DISPATCHING -> RUNNING, started_at."""
        now = self.clock.now()
        sc = self.sc

        def tx(conn) -> list[tuple]:
            rows = conn.execute(
                """select task_id, tenant_id, version, fairness_units, current_attempt_id, idempotency_key
                     from generation_task where state = 'DISPATCHING' and started_at is null""").fetchall()
            out = []
            for r in rows:
                moved = cas_transition(conn, tenant_id=r["tenant_id"], task_id=r["task_id"], from_state="DISPATCHING",
                                       version=r["version"], to_state="RUNNING", now=now, started_at=now)
                if moved is None:
                    self.stats.cas_lost += 1
                    continue
                out.append((r["current_attempt_id"], r["task_id"], r["tenant_id"], moved["version"],
                            runtime_for(r["idempotency_key"], r["fairness_units"], sc.runtime_per_unit, sc.jitter, self.seed,
                                        sc.runtime_draws.get(r["idempotency_key"]))))
            if out:
                conn.execute(
                    """update task_attempt set state = 'RUNNING', submit_started_at = %s, submit_finished_at = %s,
                              provider_job_id = attempt_id::text, updated_at = %s
                        where attempt_id = any(%s) and state = 'DISPATCHING'""",
                    (now, now, now, [o[0] for o in out]))
            return out

        for attempt_id, task_id, tenant_id, version, runtime in self.p.db.transaction(tx):
            self.running[attempt_id] = (task_id, tenant_id, version)
            self.stats.runtimes[task_id] = runtime
            self._push(_ms(self.clock.t + runtime), COMPLETE, attempt_id)

    def _complete(self, attempts: list[UUID]) -> None:
        """The provider finished these attempts: the task succeeds and its reservations are released,
        in one transaction."""
        now = self.clock.now()

        def tx(conn) -> None:
            for attempt_id in attempts:
                task_id, tenant_id, version = self.running[attempt_id]
                row = cas_transition(conn, tenant_id=tenant_id, task_id=task_id, from_state="RUNNING", version=version,
                                     to_state="PROVIDER_SUCCEEDED", now=now)
                if row is not None:
                    row = cas_transition(conn, tenant_id=tenant_id, task_id=task_id, from_state="PROVIDER_SUCCEEDED",
                                         version=row["version"], to_state="SUCCEEDED", now=now, finished_at=now)
                if row is None:
                    self.stats.cas_lost += 1
                release_attempt(conn, attempt_id, now)
            conn.execute("update task_attempt set state = 'SUCCEEDED', updated_at = %s where attempt_id = any(%s)",
                         (now, list(attempts)))

        self.p.db.transaction(tx)
        for attempt_id in attempts:
            _, tenant_id, _ = self.running.pop(attempt_id)
            g = self.group_of.get(tenant_id)
            if g in self.group_left:
                self.group_left[g] -= 1

    # -- scheduled maintenance ----------------------------------------------------------------------
    def _maintain(self) -> None:
        age_tasks(self.p)
        detect_starvation(self.p)
        with self.p.db.connection() as conn:
            for lane in self.sc.lanes:
                self.ring.rebuild(conn, lane)
        self.stats.maintenance_runs += 1
