"""The fair scheduler (ch. 18.4-18.7, 18.12-18.13; the fair-queue article).

A tick walks the lanes in order; in each lane it takes tenants from the ring of active tenants and
runs Deficit Round Robin over cost units: a visit adds quantum = base_quantum x weight (less any
fairness debt) to the tenant's deficit, capped at quantum x burst_rounds, then claims the tenant's
head tasks (priority band, then FIFO) while their units fit the deficit. Each visit is one
transaction that locks the tenant's DRR row (SKIP LOCKED, so replicas never serve one tenant twice
at once), claims under savepoints, and stores the new deficit with the claims it paid for."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from uuid import UUID

import psycopg

from aivedio import degraded
from aivedio.billing import budgets
from aivedio.billing.errors import BudgetExceeded, CurrencyMismatch
from aivedio.metrics_catalog import CLAIMS, FIT_SCAN_SKIPS
from aivedio.observability import logger, publish
from aivedio.scheduling import drr, router
from aivedio.scheduling.claim import ENTERPRISE, LENDER_KEY, Claimed, NoRoom, claim
from aivedio.scheduling.resources import account_key, free_units, preferred_shard
from aivedio.scheduling.ring import DOWN, MISSING, READY, Ring

# Lanes whose tasks may borrow the enterprise lane's idle capacity (bounded by borrowable_units).
BORROWERS = ("PAID_SHARED", "STANDARD")
PAUSED_WHEN_CONSERVATIVE = ("BEST_EFFORT", "EXPENSIVE")
# A task whose project budget is spent is looked at again after this long (the budget may be raised,
# or a reservation released, meanwhile).
PROJECT_BUDGET_RETRY_SECONDS = 60


@dataclass
class VisitResult:
    outcome: str  # CLAIMED, CREDITED (banked deficit only), EMPTY, WAITING (not eligible yet), BUSY, CAPPED, SKIPPED,
    #                BLOCKED, FULL, HELD (its turn could not begin: the key it needs is full)
    claims: list[Claimed] = field(default_factory=list)
    more: bool = False  # the batch filled while deficit remains: the tenant's turn continues
    pending: bool = False  # stopped by shared capacity (FULL, or a BLOCKED head that holds the lane) with deficit left


@dataclass
class TickReport:
    claims: int = 0
    visits: int = 0
    conservative: bool = False
    by_lane: dict[str, int] = field(default_factory=dict)


def _policy(conn, tenant_id: UUID) -> dict:
    return conn.execute("select * from tenant_scheduling_policy where tenant_id = %s", (tenant_id,)).fetchone()


def head_tasks(conn, lane: str, tenant_id: UUID, now, limit: int, *, skip_users: list[UUID] | None = None,
               skip_tasks: list[UUID] | None = None) -> list[dict]:
    """A tenant's next tasks in a lane: best priority band first, FIFO within a band. `skip_users`
    leaves out users at their own caps (and `skip_tasks` what the visit has already read), so a visit
    can go on with the tenant's other users."""
    return conn.execute(
        """select * from generation_task
            where state = 'QUEUED' and queue_class = %s and tenant_id = %s and next_eligible_at <= %s
              and user_id <> all(%s::uuid[]) and task_id <> all(%s::uuid[])
            order by priority_band, next_eligible_at, enqueue_at limit %s""",
        (lane, tenant_id, now, skip_users or [], skip_tasks or [], limit),
    ).fetchall()


def _waiting(conn, lane: str, tenant_id: UUID) -> bool:
    """Whether the tenant has queued tasks in the lane (asked when none of them is eligible now)."""
    return conn.execute(
        "select exists(select 1 from generation_task where state = 'QUEUED' and queue_class = %s and tenant_id = %s) as w",
        (lane, tenant_id)).fetchone()["w"]


# Paused turns (migration 0100): the turn that capacity cut short, per key, oldest first.
# The first few per key are enough: a tick resumes about as many turns on a key as it has free slots.
PAUSED_TURNS = """select tenant_id, paused_on, paused_kind from (
                    select tenant_id, paused_on, paused_kind, paused_at, turn_ended_at,
                           row_number() over (partition by paused_on
                                              order by paused_kind = 'WAITING', case when paused_kind = 'TURN' then paused_at end,
                                                       turn_ended_at nulls first, tenant_id) as n
                      from drr_lane_tenant where lane = %(lane)s and paused_kind is not null) q
                   where n <= %(per_key)s
                   order by paused_kind = 'WAITING', case when paused_kind = 'TURN' then paused_at end,
                            turn_ended_at nulls first, tenant_id"""
CLEAR_PAUSE = """update drr_lane_tenant set paused_on = null, paused_at = null, paused_kind = null, updated_at = %s
                  where lane = %s and tenant_id = %s and paused_kind is not null"""
PROVIDER_FREE = """select coalesce(sum(greatest(0, least(capacity_units, coalesce(limit_units, capacity_units)) - used_units)),
                              0)::bigint as free
                     from resource_pool_shard where resource_key = any(%s)"""


def _can_ever_fit(conn, key: str, task: dict) -> bool:
    """Whether the task's demand on `key` fits one shard of it when that shard is empty."""
    units = task["fairness_units"] if key.startswith("lane:") else task["provider_slot_units"]
    row = conn.execute(
        """select coalesce(max(least(capacity_units, coalesce(limit_units, capacity_units))), 0)::bigint as m
             from resource_pool_shard where resource_key = %s""", (key,)).fetchone()
    return int(row["m"]) >= units


class LaneView:
    """What one tick knows about a lane's capacity, including the enterprise lane it may borrow."""

    def __init__(self, platform, conn, lane: str):
        self.platform, self.lane = platform, lane
        cfg = platform.config.lanes
        self.free = free_units(conn, f"lane:{lane}")
        # Provider slots bind a claim as much as the lane does, and usually first (ch. 18.5.3): with
        # none free anywhere no claim can succeed, and a lane "with room" would otherwise grant
        # several rounds' quanta that the provider then cannot serve.
        accounts = [account_key(p.name, a.account_id) for p in platform.config.providers for a in p.accounts]
        self.provider_free = int(conn.execute(PROVIDER_FREE, (accounts,)).fetchone()["free"])
        self.can_borrow = False
        if lane in BORROWERS and cfg[ENTERPRISE].borrowable_units > 0:
            # Reserved demand returning stops new borrowing at once; running borrowed work finishes.
            # The lane is a literal, not a parameter: once psycopg prepares the statement, PostgreSQL's
            # generic plan for `queue_class = $1` seq-scanned generation_task (the lane's rows are rare).
            reserved_waiting = conn.execute(
                f"select exists(select 1 from generation_task where state = 'QUEUED' and queue_class = '{ENTERPRISE}') as w"
            ).fetchone()["w"]
            ent_free = free_units(conn, f"lane:{ENTERPRISE}")
            lend_room = free_units(conn, LENDER_KEY)
            self.borrow_room = min(lend_room, max(0, ent_free - cfg[ENTERPRISE].min_headroom_units))
            self.can_borrow = not reserved_waiting and self.borrow_room > 0

    @property
    def lane_has_room(self) -> bool:
        return self.free > 0 or self.can_borrow

    @property
    def has_room(self) -> bool:
        return self.lane_has_room and self.provider_free > 0

    @property
    def scarce_room(self) -> int:
        """The room of the scarcer of the lane and the providers' slots, for the rounds multiplier."""
        return min(self.free, self.provider_free)


class Scheduler:
    def __init__(self, platform):
        self.platform = platform
        self.ring = Ring(platform)
        self.cfg = platform.config.scheduler
        self._ensured: set[tuple[str, int]] = set()
        self._weight_max, self._weight_read_at = 1, None

    # -- one tenant visit ---------------------------------------------------------------------
    def visit(self, lane: str, tenant_id: UUID, view: LaneView, conservative: bool, continuation: bool = False,
              rounds: int = 1) -> VisitResult:
        """One DRR turn (or, with continuation, the rest of a turn cut short by the batch size: no
        new quantum, so batching never changes the shares). `rounds` > 1 grants that many quanta at
        once, for a lane with room for that many rounds of every active tenant (see _rounds): the
        same shares in fewer visits. What such a turn leaves unspent is not banked beyond one round's
        cap, so abundance never turns into a burst once the lane is scarce again."""
        p = self.platform
        batch = self.cfg.conservative_batch_size if conservative else self.cfg.batch_size

        def tx(conn: psycopg.Connection) -> VisitResult:
            now = p.clock.now()
            conn.execute("insert into drr_lane_tenant (lane, tenant_id, deficit, active) values (%s, %s, 0, false) on conflict do nothing",
                         (lane, tenant_id))
            st = conn.execute("select * from drr_lane_tenant where lane = %s and tenant_id = %s for update skip locked",
                              (lane, tenant_id)).fetchone()
            if st is None:
                return VisitResult("BUSY")
            # A turn that capacity paused resumes as a continuation, in whichever process or tick
            # visits next: its quantum was granted when it started.
            resuming = continuation or st["paused_kind"] == "TURN"
            policy = _policy(conn, tenant_id)
            heads = head_tasks(conn, lane, tenant_id, now, self.cfg.fit_scan_depth)
            if not heads:
                # The turn is over either way: a paused turn with nothing to claim must not hold its key.
                if _waiting(conn, lane, tenant_id):
                    # Queued, but not eligible yet (a requeue's backoff after a 429): the tenant stays
                    # on the ring, or nothing would visit it again until the index is rebuilt.
                    if st["paused_kind"] is not None:
                        conn.execute(CLEAR_PAUSE, (now, lane, tenant_id))
                    return VisitResult("WAITING")
                conn.execute("""update drr_lane_tenant set active = false, paused_on = null, paused_at = null,
                                        paused_kind = null, updated_at = %s where lane = %s and tenant_id = %s""",
                             (now, lane, tenant_id))
                return VisitResult("EMPTY")
            turn = drr.begin_turn(deficit=st["deficit"], active=st["active"], fairness_debt=st["fairness_debt"],
                                  weight=policy["weight"], base_quantum=self.cfg.base_quantum,
                                  initial_burst_credit=policy["initial_burst_credit"], burst_rounds=policy["burst_rounds"],
                                  biggest_head=max(h["fairness_units"] for h in heads), rounds=rounds, resuming=resuming)
            deficit, debt_paid, cap = turn.deficit, turn.debt_paid, turn.cap
            claims: list[Claimed] = []
            outcome = "CREDITED"
            pending = False
            too_big: int | None = None  # units of a head that did not fit the room left this visit
            wait_key: str | None = None  # the shared key without room that stopped the turn
            # One shard index for every claim of this visit (see claim()): a per-task shard made two
            # concurrent batches lock shards in opposite orders and deadlock. Varies per visit.
            prefer = preferred_shard(tenant_id) + st["visits"]
            tier = lane if lane in ("EXPENSIVE", "RECOVERY") else policy["service_class"]
            capped_users: set[UUID] = set()  # users at their own running caps: skipped for the rest of the visit
            rescanned = False
            i = -1
            while True:
                if i + 1 >= len(heads):
                    if not capped_users or rescanned or len(heads) < self.cfg.fit_scan_depth or len(claims) >= batch:
                        break
                    # Every head read was looked at and some were a capped user's: read the other
                    # users' next heads, once per visit (a bounded scan).
                    rescanned = True
                    heads = heads + head_tasks(conn, lane, tenant_id, now, self.cfg.fit_scan_depth,
                                               skip_users=list(capped_users), skip_tasks=[h["task_id"] for h in heads])
                    if i + 1 >= len(heads):
                        break
                i += 1
                task = heads[i]
                if task["user_id"] in capped_users:
                    continue
                if len(claims) >= batch or not drr.fits(task["fairness_units"], deficit):
                    break
                if too_big is not None and task["fairness_units"] >= too_big:
                    continue  # fails the same way as the head that just did not fit
                if not view.lane_has_room:
                    # as below, without a claim that must fail (full providers are left to the claim,
                    # which names the key this task waits for)
                    outcome, pending, wait_key = "FULL", True, f"lane:{lane}"
                    break
                try:
                    c = self._claim_one(conn, task, policy, view, tier, now, prefer)
                except NoRoom as e:
                    if e.key == "task:moved":
                        continue
                    if e.key.startswith("project:"):
                        # Its project's budget is spent: the task waits a while, and the tenant's other
                        # projects go on (capping the tenant would let it block them for a whole period).
                        self._defer(conn, lane, task, now, e.key)
                        continue
                    if e.user_bound:
                        # This user is at its own cap: its other tasks wait, the tenant's other users
                        # go on (ch. 18.5: users are isolated inside a tenant). Only tenant: keys end the turn.
                        capped_users.add(task["user_id"])
                        publish(FIT_SCAN_SKIPS, lane=lane, reason="user_capped")
                        continue
                    if e.tenant_bound:
                        outcome = "CAPPED"
                        break
                    if free_units(conn, e.key) <= 0:
                        # The lane (or provider) is full: no task of any size fits, so this is not a
                        # skip. The turn pauses with its deficit and resumes when room frees.
                        outcome, pending, wait_key = "FULL", True, e.key
                        break
                    # Fit scan (ch. 18.6.7): skip a task that does not fit, in favour of this tenant's
                    # smaller tasks behind it, a bounded number of times; then stop skipping it so it
                    # is not starved by them.
                    smaller_behind = any(h["fairness_units"] < task["fairness_units"] for h in heads[i + 1:])
                    if smaller_behind and task["skip_count"] < self.cfg.max_skips:
                        outcome = "SKIPPED"
                        too_big = task["fairness_units"]
                        conn.execute("update generation_task set skip_count = skip_count + 1 where task_id = %s and state = 'QUEUED'",
                                     (task["task_id"],))
                        continue
                    # The turn waits for it and holds the lane: nothing else is claimed there until it
                    # fits. Handing the room to other tenants instead starves it: they fill every unit
                    # that frees, one by one (the simulation measured 8-unit tasks at 0.74 of their
                    # fair share). A head that can never fit does not hold the lane.
                    self._intervene(conn, lane, task, "HEAD_BLOCKED", {"resource": e.key, "skips": task["skip_count"]})
                    outcome = "BLOCKED"
                    pending = _can_ever_fit(conn, e.key, task)
                    wait_key = e.key if pending else None
                    break
                claims.append(c)
                view.provider_free -= task["provider_slot_units"]
                if c.capacity_mode == "BORROWED":  # the view's lending room shrinks claim by claim, so
                    view.borrow_room -= c.units  # one visit cannot lend into min_headroom_units
                    view.can_borrow = view.borrow_room > 0
                deficit -= c.units
            if capped_users and not claims and outcome == "CREDITED":
                outcome = "CAPPED"  # every user with work here is at its cap
            served = sum(c.units for c in claims)
            # The batch filled with deficit left: the turn continues with the next head, or, when every
            # head read was claimed, with the tenant's next tasks (there may be more than were read).
            if len(heads) > len(claims):
                next_fits = drr.fits(heads[len(claims)]["fairness_units"], deficit)
            else:
                next_fits = len(heads) >= self.cfg.fit_scan_depth and deficit > 0
            more = len(claims) >= batch and next_fits
            if outcome == "FULL" and wait_key is not None and not claims and not resuming:
                # The key this tenant needs is full: its turn does not begin, so it is neither
                # credited nor charged for the wait (ch. 18.6: a turn starts when work can be sent).
                # It waits for the key with the other contenders; tenants whose work needs other
                # keys (another provider account) go on meanwhile.
                conn.execute(
                    """update drr_lane_tenant set paused_on = %s, paused_kind = 'WAITING', updated_at = %s,
                              paused_at = case when paused_on = %s and paused_kind = 'WAITING' then paused_at else %s end
                        where lane = %s and tenant_id = %s""", (wait_key, now, wait_key, now, lane, tenant_id))
                return VisitResult("HELD")
            if pending or more:  # the turn goes on when its key has room (or at once, for `more`)
                paused_on, kind = (wait_key if pending else f"lane:{lane}"), "TURN"
                paused_at = st["paused_at"] if st["paused_on"] == paused_on and st["paused_kind"] == "TURN" else now
                ended_at = st["turn_ended_at"]
            else:
                paused_on, kind, paused_at, ended_at = None, None, None, now
            deficit = drr.end_turn(deficit, cap, continues=more)  # nothing beyond one round's cap is banked
            conn.execute(
                """update drr_lane_tenant set deficit = %s, fairness_debt = fairness_debt - %s, active = true,
                          served_units = served_units + %s, visits = visits + 1, last_active_at = %s, updated_at = %s,
                          paused_on = %s, paused_kind = %s, paused_at = %s, turn_ended_at = %s
                    where lane = %s and tenant_id = %s""",
                (deficit, debt_paid, served, now, now, paused_on, kind, paused_at, ended_at, lane, tenant_id),
            )
            return VisitResult("CLAIMED" if claims else outcome, claims, more, pending or more)

        result = p.db.transaction(tx)
        if result.outcome == "EMPTY":
            self.ring.remove(lane, tenant_id)
            # A task admitted after the visit looked, whose queue indexer added the tenant before this
            # removal, would be off the ring until a rebuild: look again now that it is removed.
            with p.db.connection() as conn:
                if _waiting(conn, lane, tenant_id):
                    self.ring.add(lane, tenant_id)
        for c in result.claims:
            view.free -= c.units if c.capacity_mode == "NORMAL" else 0
        if result.claims:  # one EMF document per lane and visit, not one per claim
            publish(CLAIMS, len(result.claims), lane=lane)
        return result

    def _claim_one(self, conn, task: dict, policy: dict, view: LaneView, tier: str, now, prefer: int | None = None) -> Claimed:
        routes = router.route(self.platform, task, tier)
        if not routes:
            raise NoRoom("provider:none")
        lease = self.platform.clock.real_seconds(self.platform.config.timers.lease_seconds)
        shards = self.platform.config.limits.pool_shards
        last: NoRoom | None = None
        options = [(f"lane:{task['queue_class']}", False)]
        if view.can_borrow and task["queue_class"] in BORROWERS and task["fairness_units"] <= view.borrow_room:
            options.append((f"lane:{ENTERPRISE}", True))
        with_budgets = budgets.in_force(self.platform)
        for lane_key, borrowed in options:
            for r in routes:
                try:
                    if not with_budgets:
                        return claim(conn, task, r, policy, lane_key=lane_key, borrowed=borrowed, shards=shards,
                                     lease_seconds=lease, now=now, ensured=self._ensured, prefer=prefer)
                    return self._claim_within_budgets(conn, task, r, policy, lane_key=lane_key, borrowed=borrowed,
                                                      shards=shards, lease=lease, now=now, prefer=prefer)
                except NoRoom as e:
                    last = e
                    if e.tenant_bound or e.key == "task:moved" or e.key.startswith("project:"):
                        raise
                    if e.key.startswith("lane:") or e.key == LENDER_KEY:
                        break  # another provider will not make the lane bigger
        raise last or NoRoom("provider:none")

    def _claim_within_budgets(self, conn, task: dict, r, policy: dict, *, lane_key: str, borrowed: bool, shards: int,
                              lease: float, now, prefer: int | None) -> Claimed:
        """The claim and the attempt's budget reservation (ch. 20.9.4) under one savepoint: a
        budget that refuses takes the claim back. A tenant's own budget caps the tenant; any other
        scope is a route without room, so the next route (another account, region) is tried."""
        scopes = budgets.attempt_scopes(task["tenant_id"], r.provider, r.account, r.model, r.region, project=task["project_id"])
        try:
            with conn.transaction():
                c = claim(conn, task, r, policy, lane_key=lane_key, borrowed=borrowed, shards=shards,
                          lease_seconds=lease, now=now, ensured=self._ensured, prefer=prefer)
                budgets.reserve(conn, scopes=scopes, amount=r.expected_cost, currency=r.currency, business_key=f"attempt:{c.attempt_id}",
                                now=now, config=self.platform.config.billing, attempt_id=c.attempt_id,
                                task_id=task["task_id"], tenant_id=task["tenant_id"], costly=task["queue_class"] == "EXPENSIVE",
                                low_priority=task["priority_band"] >= budgets.LOW_PRIORITY_BAND)
                return c
        except (BudgetExceeded, CurrencyMismatch) as e:
            scope = (e.details or {}).get("scope", "")
            if scope.startswith("TENANT:"):
                raise NoRoom(f"tenant:{task['tenant_id']}:budget") from None
            if scope.startswith("PROJECT:"):  # no other route gives it room; the visit defers the task
                raise NoRoom(f"project:{task['tenant_id']}:{task['project_id']}:budget") from None
            raise NoRoom(f"budget:{scope or 'unknown'}") from None

    def _defer(self, conn, lane: str, task: dict, now, key: str) -> None:
        eligible = now + timedelta(seconds=PROJECT_BUDGET_RETRY_SECONDS)
        conn.execute("update generation_task set next_eligible_at = %s where task_id = %s and state = 'QUEUED'",
                     (eligible, task["task_id"]))
        logger.info("task deferred: its project's budget is spent", extra={
            "lane": lane, "tenant_id": str(task["tenant_id"]), "task_id": str(task["task_id"]), "budget": key,
            "next_eligible_at": eligible.isoformat()})

    def _intervene(self, conn, lane: str, task: dict, kind: str, detail: dict) -> None:
        import json

        conn.execute(
            """insert into scheduler_intervention (lane, tenant_id, task_id, kind, detail)
               select %s, %s, %s, %s, %s
                where not exists (select 1 from scheduler_intervention where task_id = %s and kind = %s)""",
            (lane, task["tenant_id"], task["task_id"], kind, json.dumps(detail), task["task_id"], kind),
        )
        logger.info("scheduler intervention", extra={"lane": lane, "tenant_id": str(task["tenant_id"]),
                                                     "task_id": str(task["task_id"]), "kind": kind, **detail})

    # -- a tick ---------------------------------------------------------------------------------
    def tick(self, budget_seconds: float | None = None, lanes: list[str] | None = None) -> TickReport:
        p = self.platform
        deadline = time.monotonic() + (budget_seconds if budget_seconds is not None else self.cfg.tick_budget_seconds)
        report = TickReport()
        # A capacity counter known to be wrong (the capacity-counters service found it and has not
        # committed the repair yet): conservative capacity mode until it has (ch. 18.18).
        suspect = degraded.capacity_suspect(p)
        for lane in lanes or self.cfg.lane_order:
            state = self.ring.index_state(lane)
            use_redis = state == READY
            if state == MISSING:  # flushed, restarted empty, or stale: rebuilt now; this tick stays conservative
                with p.db.connection() as conn:
                    self.ring.rebuild(conn, lane)
            elif state == DOWN:  # the PostgreSQL ring serves until Redis answers (nothing to rebuild into yet)
                degraded.redis_down(p, "the scheduler tick could not read the queue index")
            elif state == READY:
                degraded.leave(p, degraded.REDIS)
            conservative = not use_redis or suspect
            report.conservative |= conservative
            if conservative and lane in PAUSED_WHEN_CONSERVATIVE:
                continue
            report.by_lane[lane] = self._run_lane(lane, use_redis, conservative, deadline, report)
        report.claims = sum(report.by_lane.values())
        return report

    def _rounds(self, view: LaneView, ring_size: int | None) -> int:
        """How many DRR rounds the free room holds for every active tenant at once, counting each at
        the heaviest weight (so a round's quanta never add up to more than the room). The room is
        the scarcer of the lane's and the providers' free slots: a lane of 200 in front of an account
        of 6 is scarce. While room is scarce it is 1: the classic turn, a quantum each, so a newcomer
        waits about one slot per backlogged tenant (ch. 18.6). With room to spare, a turn takes that
        many quanta: the same weighted shares in fewer visits. Without the ring's size (conservative
        mode) it is 1."""
        room = view.scarce_room
        if not ring_size or room < 2 * ring_size * self.cfg.base_quantum:
            return 1  # (not even two rounds at weight 1: no need to read the weights)
        return max(1, room // (ring_size * self.cfg.base_quantum * self._max_weight()))

    def _max_weight(self) -> int:
        """The heaviest tenant weight, read at most once a minute (weights change by operator action)."""
        now = time.monotonic()
        if self._weight_read_at is None or now - self._weight_read_at > 60:
            self._weight_max = int(self.platform.db.fetchone(
                "select coalesce(max(weight), 1) as w from tenant_scheduling_policy")["w"])
            self._weight_read_at = now
        return self._weight_max

    def _turn(self, lane: str, tenant: UUID, view: LaneView, conservative: bool, deadline: float, *,
              continuation: bool = False, rounds: int = 1) -> tuple[VisitResult, int]:
        """One tenant's turn: a visit, and its continuations while the batch fills with deficit left."""
        r = self.visit(lane, tenant, view, conservative, continuation=continuation, rounds=rounds)
        claimed = 0
        while r.more and view.has_room and time.monotonic() < deadline:
            claimed += len(r.claims)
            r = self.visit(lane, tenant, view, conservative, continuation=True)
        return r, claimed + len(r.claims)

    def _run_lane(self, lane: str, use_redis: bool, conservative: bool, deadline: float, report: TickReport) -> int:
        p = self.platform
        claimed = idle = 0
        with p.db.connection() as conn:
            view = LaneView(p, conn, lane)
            ring_size = self.ring.size(lane, use_redis)
            paused = conn.execute(PAUSED_TURNS, {"lane": lane, "per_key": self.cfg.max_idle_visits}).fetchall() \
                if view.has_room else []
            # DRR keeps its pointer on a tenant until its deficit is spent: a turn cut short by
            # capacity resumes first once the key it waits for has room, in whichever process or
            # Lambda invocation ticks (the turn is in PostgreSQL). Rotating the ring on every freed
            # slot instead gave each backlogged tenant one slot per turn, whatever its weight.
            room = {key: (1 << 30 if view.lane_has_room else 0) if key == f"lane:{lane}" else free_units(conn, key)
                    for key in {row["paused_on"] for row in paused}}
            resumable = []
            for row in paused:  # at most one visit per free slot of the key
                if room[row["paused_on"]] > 0:
                    room[row["paused_on"]] -= 1
                    resumable.append(row["tenant_id"])
        for tenant in resumable:  # oldest first; a waiting tenant's turn begins here, with its quantum
            if time.monotonic() >= deadline or not view.has_room:
                break
            r, n = self._turn(lane, tenant, view, conservative, deadline)
            report.visits += 1
            claimed += n
            if r.pending and r.outcome == "BLOCKED":
                return claimed  # its head holds the lane until it fits
        limit_idle = min(self.cfg.max_idle_visits, (ring_size or self.cfg.max_idle_visits) + 1)
        # The multiplier is fixed for a whole rotation of the ring, so every tenant of a round gets
        # the same number of quanta; it is read again at the start of the next rotation.
        rounds, turns_left = self._rounds(view, ring_size), ring_size or 1
        while time.monotonic() < deadline and view.has_room:
            with p.db.connection() as conn:
                tenant = self.ring.next(conn, lane, use_redis)
            if tenant is None:
                break
            if turns_left <= 0:
                rounds, turns_left = self._rounds(view, ring_size), ring_size or 1
            turns_left -= 1
            r, n = self._turn(lane, tenant, view, conservative, deadline, rounds=rounds)
            report.visits += 1
            if n:
                claimed += n
                idle = 0
            elif r.outcome != "CREDITED":  # a visit that only banked deficit is progress too
                idle += 1
            if r.pending and (not view.lane_has_room or r.outcome == "BLOCKED"):
                # The lane is full, or a head that does not fit yet holds it (see visit): the paused
                # turn resumes first when room frees.
                break
            if idle >= limit_idle:
                break
            if n or idle % 8 == 7:
                with p.db.connection() as conn:
                    view = LaneView(p, conn, lane)
        return claimed
