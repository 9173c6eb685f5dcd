"""The fair scheduler (ch. 18.4-18.7, 18.12-18.13; the fair-queue article).

A tick walks the lanes in order; in each lane it takes tenants from the ring of active tenants and
runs Deficit Round Robin over cost units: a visit adds quantum = base_quantum x weight (less any
fairness debt) to the tenant's deficit, capped at quantum x burst_rounds, then claims the tenant's
head tasks (priority band, then FIFO) while their units fit the deficit. Each visit is one
transaction that locks the tenant's DRR row (SKIP LOCKED, so replicas never serve one tenant twice
at once), claims under savepoints, and stores the new deficit with the claims it paid for."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Callable, TypeVar
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from aivedio import degraded
from aivedio.metrics_catalog import CLAIMS, FIT_SCAN_SKIPS, QUEUE_WAIT_SECONDS
from aivedio.observability import logger, publish
from aivedio.policy import capacity
from aivedio.policy.tenant_policy import POLICY_EPOCH, admitted_service_class
from aivedio.scheduling import drr, resources, router
from aivedio.scheduling.claim import ENTERPRISE, LENDER_KEY, Claimed, NoRoom, claim
from aivedio.scheduling.resources import account_key, free_units, preferred_shard
from aivedio.scheduling.ring import DOWN, MISSING, READY, Ring
from aivedio.spend import budgets
from aivedio.spend.budgets import BudgetExceeded, CurrencyMismatch

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
    drained: bool = False  # the visit claimed the tenant's last queued task in the lane: it leaves the ring


@dataclass
class TickReport:
    claims: int = 0
    visits: int = 0
    conservative: bool = False
    by_lane: dict[str, int] = field(default_factory=dict)


def _policy(conn, tenant_id: UUID) -> dict:
    return conn.execute("select * from tenant_scheduling_policy where tenant_id = %s", (tenant_id,)).fetchone()


def head_tasks(conn, lane: str, tenant_id: UUID, now, limit: int, *, skip_users: list[UUID] | None = None,
               skip_tasks: list[UUID] | None = None, skip_shapes: list[str] | None = None) -> list[dict]:
    """A tenant's next tasks in a lane: best priority band first, FIFO within a band. `skip_users`
    leaves out users at their own caps (and `skip_tasks` what the visit has already read), so a visit
    can go on with the tenant's other users; `skip_shapes` leaves out tasks of those shapes (see
    task_shape), whose pools the visit found stopped, so it can go on with the tenant's other pools."""
    return conn.execute(
        """select * from generation_task
            where state = 'QUEUED' and queue_class = %s and tenant_id = %s and next_eligible_at <= %s
              and user_id <> all(%s::uuid[]) and task_id <> all(%s::uuid[])
              and model_code || '/' || resolution || '/' || duration_seconds <> all(%s::text[])
            order by priority_band, next_eligible_at, enqueue_at limit %s""",
        (lane, tenant_id, now, skip_users or [], skip_tasks or [], skip_shapes or [], limit),
    ).fetchall()


def task_shape(task: dict) -> str:
    """What decides a task's pool (router.candidates): its model, resolution and duration, as
    head_tasks' skip_shapes spells it."""
    return f"{task['model_code']}/{task['resolution']}/{task['duration_seconds']}"


def _waiting(conn, lane: str, tenant_id: UUID) -> bool:
    """Whether the tenant has queued tasks in the lane (asked when none of them is eligible now)."""
    return conn.execute(
        "select exists(select 1 from generation_task where state = 'QUEUED' and queue_class = %s and tenant_id = %s) as w",
        (lane, tenant_id)).fetchone()["w"]


# Paused turns (migrations 0100, 0210): the turns that capacity cut short, per key, oldest first,
# one row per paused pool of a tenant (a row from before 0210 is its own single pool). The first few
# per key are enough: a tick resumes about as many turns on a key as it has free slots.
PAUSED_TURNS = """select tenant_id, paused_on, paused_kind from (
                    select tenant_id, paused_on, paused_kind, paused_at, turn_ended_at,
                           row_number() over (partition by paused_on
                                              order by paused_kind = 'WAITING', case when paused_kind = 'TURN' then paused_at end,
                                                       turn_ended_at nulls first, tenant_id) as n
                      from (select d.tenant_id, t.paused_on, t.paused_kind, t.paused_at, t.turn_ended_at
                              from drr_lane_tenant d
                              cross join lateral (
                                  select e.value->>'on' as paused_on, e.value->>'kind' as paused_kind,
                                         (e.value->>'at')::timestamptz as paused_at, (e.value->>'ended')::timestamptz as turn_ended_at
                                    from jsonb_each(d.pool_turns) e
                                   where e.value->>'kind' is not null
                                  union all
                                  select d.paused_on, d.paused_kind, d.paused_at, d.turn_ended_at where d.pool_turns = '{}'::jsonb) t
                             where d.lane = %(lane)s and d.paused_kind is not null) turns) q
                   where n <= %(per_key)s
                   order by paused_kind = 'WAITING', case when paused_kind = 'TURN' then paused_at end,
                            turn_ended_at nulls first, tenant_id"""
CLEAR_PAUSE = """update drr_lane_tenant set paused_on = null, paused_at = null, paused_kind = null, updated_at = %s, pool_turns = %s
                  where lane = %s and tenant_id = %s and paused_kind is not null"""
# The free units of each key of a set, for the keys that have shards (one round trip for the view).
KEYS_FREE = """select resource_key,
                     sum(greatest(0, least(capacity_units, coalesce(limit_units, capacity_units)) - used_units))::bigint as free
                from resource_pool_shard where resource_key = any(%s) group by resource_key"""
# The worker pool every generation task takes units of (admission: media_units >= 1 at every
# resolution); worker:gpu and the media classes bind only some tasks, so they are left to the claim.
WORKER_KEY = "worker:cpu"


ACCOUNT_PREFIX = "provider-account:"


def pool_of(config, task: dict) -> str:
    """The binding pool a task's claim draws on: the provider accounts able to run it (the
    capability matrix, router.candidates), as one key. Tasks with the same pool compete for the
    same slots; a tenant's tasks for different pools are different DRR flows."""
    return "|".join(sorted(account_key(p.name, a.account_id)
                           for p, a in router.candidates(config, task["model_code"], task["resolution"], task["duration_seconds"])))


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t is not None else None


def _at(s: str | None) -> datetime | None:
    return datetime.fromisoformat(s) if s else None


@dataclass(frozen=True)
class PoolTurn:
    """One pool's DRR turn for a tenant in a lane (drr_lane_tenant.pool_turns, migration 0210):
    its deficit, and how it stands towards the key it waits for (kind TURN or WAITING, as 0100's
    paused_kind), since when, and when its last turn ended."""
    deficit: int = 0
    kind: str | None = None
    on: str | None = None
    at: datetime | None = None
    ended: datetime | None = None

    @staticmethod
    def load(st: dict, first_pool: str | None) -> dict[str, "PoolTurn"]:
        raw = st.get("pool_turns") or {}
        if not raw:  # a row from before per-pool turns: its state is its first head's pool's
            if first_pool is None:
                return {}
            return {first_pool: PoolTurn(int(st["deficit"]), st["paused_kind"], st["paused_on"], st["paused_at"], st["turn_ended_at"])}
        return {k: PoolTurn(int(v["deficit"]), v.get("kind"), v.get("on"), _at(v.get("at")), _at(v.get("ended"))) for k, v in raw.items()}

    @staticmethod
    def dump(turns: dict[str, "PoolTurn"]) -> Jsonb:
        return Jsonb({k: {"deficit": t.deficit, "kind": t.kind, "on": t.on, "at": _iso(t.at), "ended": _iso(t.ended)}
                      for k, t in turns.items()})

    @staticmethod
    def index(turns: dict[str, "PoolTurn"]) -> tuple[str | None, str | None, datetime | None, datetime | None]:
        """(paused_on, paused_kind, paused_at, turn_ended_at) for the row: the paused pool that the
        tick's paused-turn query should resume first (TURN before WAITING, then the longest
        paused), or no pause and the latest turn end."""
        paused = [t for t in turns.values() if t.kind is not None]
        if paused:
            t = min(paused, key=lambda t: (t.kind == "WAITING", t.at))
            return t.on, t.kind, t.at, t.ended
        ended = [t.ended for t in turns.values() if t.ended is not None]
        return None, None, None, max(ended, default=None)

    def after(self, lt: "_LiveTurn", now: datetime, *, more: bool, lane_key: str) -> "PoolTurn":
        """This pool's state once the visit that served it ends."""
        if not lt.granted:  # its key was full before its turn could begin: neither credited nor charged
            at = self.at if (self.kind == "WAITING" and self.on == lt.wait_key) else now
            return PoolTurn(self.deficit, "WAITING", lt.wait_key, at, self.ended)
        on = lt.wait_key if lt.waiting else (lane_key if more and lt.open else None)
        deficit = drr.end_turn(lt.deficit, lt.cap, continues=more and on == lane_key)  # at most one round's cap is banked
        if on is None:
            return PoolTurn(deficit, None, None, None, now)
        at = self.at if (self.kind == "TURN" and self.on == on) else now
        return PoolTurn(deficit, "TURN", on, at, self.ended)


@dataclass
class _LiveTurn:
    """A pool's turn while a visit serves it."""
    deficit: int
    cap: int
    resuming: bool
    debt_paid: int
    claims: int = 0
    # None while open; SPENT (its deficit ran out, or its head can never fit), FULL (waits for
    # wait_key to have room), BLOCKED (its head holds the lane until it fits on wait_key)
    status: str | None = None
    wait_key: str | None = None
    too_big: int | None = None  # units of a head that did not fit the room left this visit

    @property
    def open(self) -> bool:
        return self.status is None

    @property
    def waiting(self) -> bool:
        """Stopped by shared capacity with deficit left: the turn goes on when wait_key has room."""
        return self.status in ("FULL", "BLOCKED") and self.wait_key is not None

    @property
    def granted(self) -> bool:
        """Whether its turn began: a pool whose key was full at its first claim, in a turn not
        already under way, waits for the key instead (its quantum is not granted)."""
        return not (self.status == "FULL" and self.wait_key is not None and self.claims == 0 and not self.resuming)


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
        cfg = capacity.effective_config(platform, conn).lanes  # with the operator's overrides (issue 16)
        self.free = free_units(conn, f"lane:{lane}")
        # Provider slots bind a claim as much as the lane does, and usually first (ch. 18.5.3): with
        # none free anywhere no claim can succeed, and a lane "with room" would otherwise grant
        # several rounds' quanta that the provider then cannot serve.
        accounts = [account_key(p.name, a.account_id) for p in platform.config.providers for a in p.accounts]
        models = [f"model:{m}" for m in platform.config.models]
        free = {r["resource_key"]: int(r["free"]) for r in conn.execute(KEYS_FREE, (accounts + models + [WORKER_KEY],))}
        self.provider_free = sum(free.get(k, 0) for k in accounts)
        # So do the models' global running caps and the workers' slots: a model cap of 6 under a lane
        # of 200 and accounts of 500 is as scarce as an account of 6. A key without shards (a pool
        # the deployment has not created) is None here: the view does not count it.
        self.model_free: int | None = sum(free[k] for k in models if k in free) if any(k in free for k in models) else None
        self.worker_free: int | None = free.get(WORKER_KEY)
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
        """Whether some claim could succeed: room on the lane (or to borrow), on some provider
        account, under some model's cap, and on the workers."""
        return (self.lane_has_room and self.provider_free > 0 and (self.model_free is None or self.model_free > 0)
                and (self.worker_free is None or self.worker_free > 0))

    @property
    def scarce_room(self) -> int:
        """The room of the scarcest of the lane, the providers' slots, the models' caps and the
        workers' slots, for the rounds multiplier."""
        return min(x for x in (self.free, self.provider_free, self.model_free, self.worker_free) if x is not None)

    def took(self, task: dict) -> None:
        """What a claim of the task took from the shared keys the view counts (the lane's units are
        counted by the caller, by capacity mode)."""
        self.provider_free -= task["provider_slot_units"]
        if self.model_free is not None:
            self.model_free -= task["provider_slot_units"]
        if self.worker_free is not None:
            self.worker_free -= task["media_units"]


def claim_options(view: LaneView, task: dict) -> list[tuple[str, bool]]:
    """(lane key, borrowed) of each way a claim of the task may take lane capacity: its own lane,
    then the enterprise lane's idle capacity, for a borrowing lane while the view lends."""
    options = [(f"lane:{task['queue_class']}", False)]
    if view.can_borrow and task["queue_class"] in BORROWERS and task["fairness_units"] <= view.borrow_room:
        options.append((f"lane:{ENTERPRISE}", True))
    return options


T = TypeVar("T")


def first_fit(routes: list[router.Route], options: list[tuple[str, bool]], attempt: Callable[[str, bool, router.Route], T]) -> T:
    """The order a claim tries its ways: each lane option over every route, best route first.
    `attempt` claims one way (or, in aivedio.scheduling.why_waiting, only checks it) and raises
    NoRoom. The task's own caps, a moved task and a project budget end the search (no other way
    gives room); a lane without room moves on to the next lane option, any other key to the next
    route; the last NoRoom is the answer. One copy, so what why_waiting names is what claims meet."""
    if not routes:
        raise NoRoom("provider:none")
    last: NoRoom | None = None
    for lane_key, borrowed in options:
        for r in routes:
            try:
                return attempt(lane_key, borrowed, r)
            except NoRoom as e:
                last = e
                if e.tenant_bound or e.key == "task:moved" or e.key.startswith("project:"):
                    raise
                if e.key.startswith("lane:") or e.key == LENDER_KEY:
                    break  # another provider will not make the lane bigger
    raise last or NoRoom("provider:none")


def budget_no_room(task: dict, scope: str) -> NoRoom:
    """What a budget refusing an attempt is to the claim: a tenant's own budget caps the tenant; a
    project's defers the task (no other route gives it room); any other scope is a route without
    room, so the next route (another account, region) is tried."""
    if scope.startswith("TENANT:"):
        return NoRoom(f"tenant:{task['tenant_id']}:budget")
    if scope.startswith("PROJECT:"):
        return NoRoom(f"project:{task['tenant_id']}:{task['project_id']}:budget")
    return NoRoom(f"budget:{scope or 'unknown'}")


class Scheduler:
    def __init__(self, platform):
        self.platform = platform
        self.ring = Ring(platform)
        self.cfg = platform.config.scheduler
        self._ensured: set[tuple[str, int]] = set()
        self._weight_max, self._weight_read_at, self._weight_epoch = 1, None, 0
        self._admitted_tiers: dict[tuple[UUID, int], str] = {}  # (tenant, policy_version): immutable history

    # -- one tenant visit ---------------------------------------------------------------------
    def visit(self, lane: str, tenant_id: UUID, view: LaneView, conservative: bool, continuation: bool = False,
              rounds: int = 1, resume_keys: frozenset[str] | None = None) -> VisitResult:
        """One DRR turn (or, with continuation, the rest of a turn cut short by the batch size: no
        new quantum, so batching never changes the shares). `rounds` > 1 grants that many quanta at
        once, for a lane with room for that many rounds of every active tenant (see _rounds): the
        same shares in fewer visits. What such a turn leaves unspent is not banked beyond one round's
        cap, so abundance never turns into a burst once the lane is scarce again.

        The turn is kept per binding pool (the accounts able to run a head, see pool_of): each pool
        the tenant has work for is its own DRR flow, with its own deficit and pause, so a full
        account pauses only that pool's turn and the tenant's work for another account goes on. A
        visit with `resume_keys` (the tick found room on those keys for this tenant's paused turns)
        serves only the pools paused on them: the others had their turn, or wait behind others."""
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
            policy = _policy(conn, tenant_id)
            heads = head_tasks(conn, lane, tenant_id, now, self.cfg.fit_scan_depth)
            if not heads:
                # The turn is over either way: a paused turn with nothing to claim must not hold its key.
                turns = {k: PoolTurn(t.deficit, ended=t.ended) for k, t in PoolTurn.load(st, None).items()}
                if _waiting(conn, lane, tenant_id):
                    # Queued, but not eligible yet (a requeue's backoff after a 429): the tenant stays
                    # on the ring, or nothing would visit it again until the index is rebuilt.
                    if st["paused_kind"] is not None:
                        conn.execute(CLEAR_PAUSE, (now, PoolTurn.dump(turns), lane, tenant_id))
                    return VisitResult("WAITING")
                conn.execute("""update drr_lane_tenant set active = false, paused_on = null, paused_at = null,
                                        paused_kind = null, pool_turns = %s, updated_at = %s where lane = %s and tenant_id = %s""",
                             (PoolTurn.dump(turns), now, lane, tenant_id))
                return VisitResult("EMPTY")
            pool_cache: dict[str, str] = {}  # task shape -> pool

            def pool(task: dict) -> str:
                k = task_shape(task)
                if k not in pool_cache:
                    pool_cache[k] = pool_of(p.config, task)
                return pool_cache[k]

            turns = PoolTurn.load(st, pool(heads[0]))
            debt_left = st["fairness_debt"]  # fairness debt is the tenant's: repaid once, from the first pool's quantum
            live: dict[str, _LiveTurn] = {}  # the pools whose turn this visit serves

            def begin(key: str) -> _LiveTurn | None:
                nonlocal debt_left
                if key in live:
                    return live[key]
                t = turns.setdefault(key, PoolTurn())
                if resume_keys is not None and (t.kind is None or t.on not in resume_keys):
                    return None  # not a turn the tick resumes: it had its turn, or waits behind others
                resuming = continuation or t.kind == "TURN"
                start = drr.begin_turn(deficit=t.deficit, active=st["active"], fairness_debt=debt_left,
                                       weight=policy["weight"], base_quantum=self.cfg.base_quantum,
                                       initial_burst_credit=policy["initial_burst_credit"], burst_rounds=policy["burst_rounds"],
                                       biggest_head=max(h["fairness_units"] for h in heads if pool(h) == key),
                                       rounds=rounds, resuming=resuming)
                debt_left -= start.debt_paid
                live[key] = _LiveTurn(start.deficit, start.cap, resuming, start.debt_paid)
                return live[key]

            claims: list[Claimed] = []
            outcome = "CREDITED"
            # One shard index for every claim of this visit (see claim()): a per-task shard made two
            # concurrent batches lock shards in opposite orders and deadlock. Varies per visit.
            prefer = preferred_shard(tenant_id) + st["visits"]
            capped_users: set[UUID] = set()  # users at their own running caps: skipped for the rest of the visit
            rescanned = pools_rescanned = False
            complete = len(heads) < self.cfg.fit_scan_depth  # every queued head was read
            stopped = False  # the whole visit is over (the batch, the lane, a tenant cap, a head that holds the lane)

            def stop_open(key: str | None) -> None:
                """The lane (or a key every pool needs) stopped the visit: every pool's turn still open waits on it."""
                for lt in live.values():
                    if lt.open:
                        lt.status, lt.wait_key = "FULL", key

            i = -1
            while not stopped:
                if i + 1 >= len(heads):
                    if complete or len(claims) >= batch:
                        break
                    open_pools = {k for k, lt in live.items() if lt.open}
                    if capped_users and not rescanned and open_pools:
                        # Every head read was looked at and some were a capped user's: read the other
                        # users' next heads, once per visit (a bounded scan).
                        rescanned, skip_shapes = True, []
                    elif not pools_rescanned and len(turns) > 1 and (open_pools or any(
                            k not in set(pool_cache.values()) and (resume_keys is None or turns[k].on in resume_keys) for k in turns)):
                        # A tenant with work for several pools: a pool whose turn can go on has no more
                        # heads in the read (the others' tasks fill it: a full account's queue grows
                        # ahead of a free one's), or one it has work for was not read at all. Read past
                        # the stopped pools' tasks, once per visit, so they do not hide the others'.
                        pools_rescanned, skip_shapes = True, [sh for sh, k in pool_cache.items() if k not in open_pools]
                    else:
                        break
                    heads = heads + head_tasks(conn, lane, tenant_id, now, self.cfg.fit_scan_depth, skip_users=list(capped_users),
                                               skip_tasks=[h["task_id"] for h in heads], skip_shapes=skip_shapes)
                    if i + 1 >= len(heads):
                        break
                i += 1
                task = heads[i]
                if task["user_id"] in capped_users:
                    continue
                if len(claims) >= batch:
                    break
                key = pool(task)
                lt = begin(key)
                if lt is None or not lt.open:
                    continue
                if not drr.fits(task["fairness_units"], lt.deficit):
                    lt.status = "SPENT"
                    continue
                if lt.too_big is not None and task["fairness_units"] >= lt.too_big:
                    continue  # fails the same way as the head that just did not fit
                if not view.lane_has_room:
                    # as below, without a claim that must fail (full providers are left to the claim,
                    # which names the key this task waits for)
                    stop_open(f"lane:{lane}")
                    outcome, stopped = "FULL", True
                    break
                try:
                    c = self._claim_one(conn, task, policy, view, self._tier(conn, lane, task, policy), now, prefer)
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
                        outcome, stopped = "CAPPED", True
                        break
                    if free_units(conn, e.key) <= 0:
                        # The key is full: no task of any size fits, so this is not a skip. The turn
                        # pauses with its deficit and resumes when room frees; a full provider account
                        # pauses only this pool's turn, and the tenant's work for other accounts goes on.
                        outcome = "FULL"
                        lt.status, lt.wait_key = "FULL", e.key
                        if not e.key.startswith(ACCOUNT_PREFIX):
                            stop_open(e.key)
                            stopped = True
                        continue
                    # Fit scan (ch. 18.6.7): skip a task that does not fit, in favour of this tenant's
                    # smaller tasks behind it (in the same pool), a bounded number of times; then stop
                    # skipping it so it is not starved by them.
                    smaller_behind = any(h["fairness_units"] < task["fairness_units"] and pool(h) == key for h in heads[i + 1:])
                    if smaller_behind and task["skip_count"] < self.cfg.max_skips:
                        outcome = "SKIPPED"
                        lt.too_big = task["fairness_units"]
                        conn.execute("update generation_task set skip_count = skip_count + 1 where task_id = %s and state = 'QUEUED'",
                                     (task["task_id"],))
                        continue
                    # The turn waits for it and holds the lane: nothing else is claimed there until it
                    # fits. Handing the room to other tenants instead starves it: they fill every unit
                    # that frees, one by one (the simulation measured 8-unit tasks at 0.74 of their
                    # fair share). A head that can never fit does not hold the lane.
                    self._intervene(conn, lane, task, "HEAD_BLOCKED", {"resource": e.key, "skips": task["skip_count"]})
                    outcome, stopped = "BLOCKED", True
                    held = _can_ever_fit(conn, e.key, task)
                    lt.status, lt.wait_key = ("BLOCKED", e.key) if held else ("SPENT", None)
                    if held:
                        stop_open(e.key)
                    break
                claims.append(c)
                lt.claims += 1
                lt.deficit -= c.units
                view.took(task)
                if c.capacity_mode == "BORROWED":  # the view's lending room shrinks claim by claim, so
                    view.borrow_room -= c.units  # one visit cannot lend into min_headroom_units
                    view.can_borrow = view.borrow_room > 0
            if capped_users and not claims and outcome == "CREDITED":
                outcome = "CAPPED"  # every user with work here is at its cap
            served = sum(c.units for c in claims)
            pending = any(lt.waiting for lt in live.values())
            # The batch filled with deficit left: the turn continues with the next head, or, when every
            # head read was claimed, with the tenant's next tasks (there may be more than were read).
            if len(heads) > len(claims):
                nxt = heads[len(claims)]
                nxt_turn = live.get(pool(nxt))
                next_fits = nxt_turn is not None and drr.fits(nxt["fairness_units"], nxt_turn.deficit)
            else:
                next_fits = len(heads) >= self.cfg.fit_scan_depth and any(lt.deficit > 0 for lt in live.values())
            more = len(claims) >= batch and next_fits
            for key, lt in live.items():
                turns[key] = turns[key].after(lt, now, more=more, lane_key=f"lane:{lane}")
            if complete:  # every queued head was read: a pool without any is idle
                seen = {pool(h) for h in heads}
                turns = {k: t for k, t in turns.items() if k in seen}
            if not claims and live and all(turns[k].kind == "WAITING" for k in live):
                # Every key this tenant needs is full: its turn does not begin, so it is neither
                # credited nor charged for the wait (ch. 18.6: a turn starts when work can be sent).
                # It waits for the key with the other contenders; tenants whose work needs other
                # keys (another provider account) go on meanwhile.
                on, kind, at, _ = PoolTurn.index(turns)
                conn.execute(
                    """update drr_lane_tenant set paused_on = %s, paused_kind = %s, paused_at = %s, pool_turns = %s,
                              updated_at = %s where lane = %s and tenant_id = %s""",
                    (on, kind, at, PoolTurn.dump(turns), now, lane, tenant_id))
                return VisitResult("HELD")
            # Every queued task the tenant had in the lane was claimed: its queue is empty, so it
            # leaves the ring now (DRR's active list holds backlogged flows only), and work it submits
            # later makes it a newcomer, who joins the round behind the tenants already waiting.
            # Left on the ring until a later visit found it empty, it kept its place: a task it
            # submitted meanwhile was served ahead of tenants that had been waiting longer, and every
            # newcomer was put ahead of it (the ring puts newcomers before the tenant served last),
            # even one that arrived after its new task (whale-provider-bound measured the waits).
            drained = (bool(claims) and not pending and not more and not capped_users
                       and len(claims) == len(heads) < self.cfg.fit_scan_depth and not _waiting(conn, lane, tenant_id))
            on, kind, at, ended = PoolTurn.index(turns)
            conn.execute(
                """update drr_lane_tenant set deficit = %s, fairness_debt = %s, active = %s,
                          served_units = served_units + %s, visits = visits + 1, last_active_at = %s, updated_at = %s,
                          paused_on = %s, paused_kind = %s, paused_at = %s, turn_ended_at = coalesce(%s, turn_ended_at),
                          pool_turns = %s
                    where lane = %s and tenant_id = %s""",
                (sum(t.deficit for t in turns.values()), st["fairness_debt"] - sum(lt.debt_paid for lt in live.values() if lt.granted),
                 not drained, served, now, now, on, kind, at, ended,
                 PoolTurn.dump(turns), lane, tenant_id),
            )
            return VisitResult("CLAIMED" if claims else outcome, claims, more, pending or more, drained)

        result = p.db.transaction(tx)
        if result.outcome == "EMPTY" or result.drained:
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
        now = p.clock.now()
        for c in result.claims:
            if c.enqueued_at is not None:
                publish(QUEUE_WAIT_SECONDS, max(0.0, (now - c.enqueued_at).total_seconds()) * p.clock.time_scale, lane=lane)
        return result

    def _tier(self, conn, lane: str, task: dict, policy: dict) -> str:
        """The routing tier: the lane's own for EXPENSIVE and RECOVERY, else the tenant's service class
        under the policy version the task was admitted with, so a policy change does not reroute the
        tasks admitted before it (issue 16)."""
        if lane in ("EXPENSIVE", "RECOVERY"):
            return lane
        if task["policy_version"] == policy["policy_version"]:
            return policy["service_class"]
        key = (task["tenant_id"], task["policy_version"])
        if key not in self._admitted_tiers:
            if len(self._admitted_tiers) > 10_000:
                self._admitted_tiers.clear()
            self._admitted_tiers[key] = admitted_service_class(conn, task, policy)
        return self._admitted_tiers[key]

    def _claim_one(self, conn, task: dict, policy: dict, view: LaneView, tier: str, now, prefer: int | None = None) -> Claimed:
        # On this transaction's connection: it may hold shard locks from this visit's claims already.
        routes = router.route(self.platform, task, tier, conn=conn)
        lease = self.platform.clock.real_seconds(self.platform.config.timers.lease_seconds)
        shards = self.platform.config.limits.pool_shards
        with_budgets = bool(routes) and budgets.in_force(self.platform, conn)

        def attempt(lane_key: str, borrowed: bool, r: router.Route) -> Claimed:
            if not with_budgets:
                return claim(conn, task, r, policy, lane_key=lane_key, borrowed=borrowed, shards=shards,
                             lease_seconds=lease, now=now, ensured=self._ensured, prefer=prefer)
            return self._claim_within_budgets(conn, task, r, policy, lane_key=lane_key, borrowed=borrowed,
                                              shards=shards, lease=lease, now=now, prefer=prefer)

        return first_fit(routes, claim_options(view, task), attempt)

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
            raise budget_no_room(task, (e.details or {}).get("scope", "")) from None

    def _defer(self, conn, lane: str, task: dict, now, key: str) -> None:
        eligible = now + timedelta(seconds=PROJECT_BUDGET_RETRY_SECONDS)
        conn.execute("update generation_task set next_eligible_at = %s where task_id = %s and state = 'QUEUED'",
                     (eligible, task["task_id"]))
        logger.info("task deferred: its project's budget is spent", extra={
            "lane": lane, "tenant_id": str(task["tenant_id"]), "task_id": str(task["task_id"]), "budget": key,
            "next_eligible_at": eligible.isoformat()})

    def _intervene(self, conn, lane: str, task: dict, kind: str, detail: dict) -> None:
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
        resources.converge(p)  # pools an operator lowered below what ran, re-split as it drains (every few s)
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
        """The heaviest tenant weight, read at most once a minute (weights change by operator action),
        and again once this process changed a policy (policy.tenant_policy.invalidate_caches)."""
        now = time.monotonic()
        epoch = self.platform.extras.get(POLICY_EPOCH, 0)
        if self._weight_read_at is None or now - self._weight_read_at > 60 or epoch != self._weight_epoch:
            self._weight_epoch = epoch
            self._weight_max = int(self.platform.db.fetchone(
                "select coalesce(max(weight), 1) as w from tenant_scheduling_policy")["w"])
            self._weight_read_at = now
        return self._weight_max

    def _turn(self, lane: str, tenant: UUID, view: LaneView, conservative: bool, deadline: float, *,
              continuation: bool = False, rounds: int = 1, resume_keys: frozenset[str] | None = None) -> tuple[VisitResult, int]:
        """One tenant's turn: a visit, and its continuations while the batch fills with deficit left."""
        r = self.visit(lane, tenant, view, conservative, continuation=continuation, rounds=rounds, resume_keys=resume_keys)
        claimed = 0
        while r.more and view.has_room and time.monotonic() < deadline:
            claimed += len(r.claims)
            r = self.visit(lane, tenant, view, conservative, continuation=True, resume_keys=resume_keys)
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
            resumable: dict[UUID, set[str]] = {}  # tenant -> the keys its paused turns resume on
            for row in paused:  # at most one visit per free slot of the key
                if room[row["paused_on"]] > 0:
                    room[row["paused_on"]] -= 1
                    resumable.setdefault(row["tenant_id"], set()).add(row["paused_on"])
        for tenant, keys in resumable.items():  # oldest first; a waiting tenant's turn begins here, with its quantum
            if time.monotonic() >= deadline or not view.has_room:
                break
            r, n = self._turn(lane, tenant, view, conservative, deadline, resume_keys=frozenset(keys))
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
