"""Tenant scheduling policies (ch. 18.9.2, 18.19.4; issue 16): shown, changed under validation of
the whole result, versioned, and snapshotted as a set.

One table, COLUMNS, says what an operator may set: its name, type and bounds drive the validation
here, the CLI's flags (`aivedio admin tenant policy set --max-user-running-tasks N`, booleans as
`--expensive-allowed true|false`) and the admin API's PATCH body. `validate` is a pure function of
the merged policy (no database), so the rules can be tested alone.

A change (`set_policy`) runs in the caller's transaction: it takes the policy-set lock (which a
lane's capacity change takes too, aivedio.admin.capacity.set_lane), reads the lanes in force, locks the
tenant's row, applies the changes, validates the whole result and either raises InvalidRequest
naming each bad field, having written nothing, or writes together: the row with policy_version + 1,
the tenant's service_class (admission reads the lane from the tenant row), a tenant_policy_history
row, a snapshot of the whole policy set (policy_set_snapshot, migration 0160), the last good set for
degraded mode, and an audit_log row with the new policy_version.

Versions and tasks: admission stamps each task with the policy_version in force, and what it decided
under that version stays with the task: its lane (queue_class), priority band and deadline are
columns of the task, and the dispatch event carries the task's policy_version. The scheduler routes
a task by the tier of the version it was admitted under (`admitted_service_class`). Limits that
bind the tenant as a whole (running caps, weight, rates) are the tenant's current ones: they are
about the tenant now, not about one task.

The last good set: the live rows are the truth; the newest snapshot is what to restore (or serve
from) if they are lost or a bad set must be rolled back as a whole, since every snapshot was
written after a set that passed `validate`. `latest_snapshot` reads it; nothing restores
automatically."""
from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg

from aivedio import audit
from aivedio.config import SERVICE_CLASSES
from aivedio.context import get_platform
from aivedio.errors import InvalidRequest, NotFound
from aivedio.policy import capacity

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_WEIGHT = 1000  # as admin.tenants.create_tenant accepts
MAX_REASON = 1000
READ_ONLY = ("tenant_id", "policy_version", "updated_at")
# Taken before the tenant's row by every change, so changes commit one at a time and each snapshot
# (read after the lock, under READ COMMITTED) includes every change committed before it; also by a
# lane's capacity change and a tenant's creation, which check reserved_units against the lane too.
# Lock order: this lock, a capacity override's key, pool shards, the audit chain head.
POLICY_SET_LOCK = "select pg_advisory_xact_lock(hashtext('tenant_scheduling_policy'))"


@dataclass(frozen=True)
class Column:
    name: str
    kind: str  # "int", "bool" or "choice"
    help: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def metavar(self) -> str:
        return {"int": "N", "bool": "true|false"}.get(self.kind, "|".join(self.choices))

    def check(self, value: Any) -> str | None:
        """What is wrong with a value of this column, or None."""
        if self.kind == "bool":
            return None if type(value) is bool else "true or false"
        if self.kind == "choice":
            return None if isinstance(value, str) and value in self.choices else f"one of {', '.join(self.choices)}"
        if type(value) is not int:  # bool is an int in Python, and not a number here
            return f"an integer, not {_kind_of(value)}"
        if self.minimum is not None and value < self.minimum:
            return "must not be negative" if self.minimum == 0 else f"must be at least {self.minimum}"
        if self.maximum is not None and value > self.maximum:
            return f"must be at most {self.maximum}"
        return None

    def parse(self, text: str) -> Any:
        """A CLI flag's text as this column's value; ValueError when it is not one."""
        if self.kind == "bool":
            low = text.strip().lower()
            if low not in ("true", "false"):
                raise ValueError("true or false")
            return low == "true"
        if self.kind == "choice":
            return text.strip()
        try:
            return int(text.strip())
        except ValueError:
            raise ValueError(f"an integer, not {text!r}") from None

    def schema(self) -> dict:
        """The column as JSON Schema (the admin API's OpenAPI document)."""
        if self.kind == "bool":
            return {"type": "boolean", "description": self.help}
        if self.kind == "choice":
            return {"type": "string", "enum": list(self.choices), "description": self.help}
        out = {"type": "integer", "description": self.help}
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out


def _kind_of(value: Any) -> str:
    return {bool: "a boolean", str: "a string", float: "a number with a fraction", type(None): "null"}.get(
        type(value), type(value).__name__)


def _i32(name: str, help: str, minimum: int = 0, maximum: int = INT32_MAX) -> Column:
    return Column(name, "int", help, minimum, maximum)


def _i64(name: str, help: str) -> Column:
    return Column(name, "int", help, 0, INT64_MAX)


# Every column of tenant_scheduling_policy (migrations 0001) but READ_ONLY, in the table's order.
COLUMNS: tuple[Column, ...] = (
    Column("service_class", "choice", "the tenant's lane and routing tier", choices=SERVICE_CLASSES),
    _i32("weight", "DRR weight: the tenant's share of its lane", 1, MAX_WEIGHT),
    _i32("max_queued_tasks", "tasks the tenant may have queued"),
    _i64("max_queued_units", "cost units the tenant may have queued"),
    _i32("max_running_tasks", "tasks the tenant may have running"),
    _i64("max_running_units", "cost units the tenant may have running"),
    _i64("max_cost_per_minute", "estimated provider cost admitted per minute"),
    _i64("max_cost_per_day", "estimated provider cost admitted per day"),
    _i64("reserved_units", "units of its lane reserved for the tenant"),
    _i64("burst_units", "units the tenant may burst above its share"),
    _i32("max_wait_seconds", "longest expected wait admission accepts"),
    _i32("max_user_queued_tasks", "tasks one user may have queued"),
    _i64("max_user_queued_units", "cost units one user may have queued"),
    _i32("max_user_running_tasks", "tasks one user may have running"),
    _i64("max_user_running_units", "cost units one user may have running"),
    _i32("user_submit_rate_per_minute", "submissions per user per minute"),
    _i32("tenant_submit_rate_per_minute", "submissions per tenant per minute"),
    _i32("cancel_rate_per_minute", "cancellations per tenant per minute"),
    Column("allow_best_effort_downgrade", "bool", "admit into BEST_EFFORT when the expected wait is too long"),
    Column("expensive_allowed", "bool", "whether the tenant may submit EXPENSIVE work"),
    _i32("burst_rounds", "DRR deficit cap, in quanta"),
    _i64("initial_burst_credit", "DRR credit of a tenant coming back from empty"),
)
BY_NAME: dict[str, Column] = {c.name: c for c in COLUMNS}
NAMES: tuple[str, ...] = tuple(BY_NAME)

# (lower, upper, why): the policy must have lower <= upper.
ORDERED: tuple[tuple[str, str, str], ...] = (
    ("max_running_tasks", "max_queued_tasks", "running caps cannot exceed queued caps"),
    ("max_running_units", "max_queued_units", "running caps cannot exceed queued caps"),
    ("max_user_running_tasks", "max_user_queued_tasks", "running caps cannot exceed queued caps"),
    ("max_user_running_units", "max_user_queued_units", "running caps cannot exceed queued caps"),
    ("max_user_queued_tasks", "max_queued_tasks", "a user's caps cannot exceed its tenant's"),
    ("max_user_queued_units", "max_queued_units", "a user's caps cannot exceed its tenant's"),
    ("max_user_running_tasks", "max_running_tasks", "a user's caps cannot exceed its tenant's"),
    ("max_user_running_units", "max_running_units", "a user's caps cannot exceed its tenant's"),
    ("reserved_units", "max_running_units", "a reservation the tenant can never run is idle capacity"),
    ("max_cost_per_minute", "max_cost_per_day", "a minute cannot allow more than its day"),
)


# --- the pure rules ---------------------------------------------------------------------------------

def check_changes(changes: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The change set's known, well-typed columns and the problems of the others."""
    if not isinstance(changes, Mapping):
        return {}, {"changes": "an object of column: value"}
    if not changes:
        return {}, {"changes": f"at least one column to change: {', '.join(NAMES)}"}
    good, bad = {}, {}
    for name, value in changes.items():
        col = BY_NAME.get(name)
        if col is None:
            bad[str(name)] = "read-only: set by every change" if name in READ_ONLY else "unknown column"
            continue
        problem = col.check(value)
        if problem:
            bad[name] = problem
        else:
            good[name] = value
    return good, bad


def validate(policy: Mapping[str, Any], *, lanes: Mapping[str, Any], changed: set[str] | None = None) -> dict[str, str]:
    """Every rule over a whole policy: {field: why} of the fields that break one (empty when it is
    valid). A rule between two fields names those of them that `changed`, or both when neither did
    (a policy already out of bounds says so)."""
    bad: dict[str, str] = {}
    for col in COLUMNS:
        if col.name not in policy:
            bad[col.name] = "missing"
            continue
        problem = col.check(policy[col.name])
        if problem:
            bad[col.name] = problem
    changed = set(changed or ())

    def blame(fields: tuple[str, ...], why: str) -> None:
        named = [f for f in fields if f in changed] or list(fields)
        for f in named:
            bad.setdefault(f, why)

    for lower, upper, why in ORDERED:
        if lower in bad or upper in bad:
            continue
        if policy[lower] > policy[upper]:
            blame((lower, upper), f"{lower} ({policy[lower]}) above {upper} ({policy[upper]}): {why}")
    lane = lanes.get(policy.get("service_class")) if "service_class" not in bad else None
    if lane is not None and "reserved_units" not in bad and policy["reserved_units"] > lane.capacity_units:
        blame(("reserved_units", "service_class"),
              f"reserved_units ({policy['reserved_units']}) above the {policy['service_class']} lane's capacity "
              f"({lane.capacity_units} units)")
    return bad


def settable(row: Mapping[str, Any]) -> dict[str, Any]:
    """The settable columns of a policy row."""
    return {n: row[n] for n in NAMES}


# --- reading -----------------------------------------------------------------------------------------

SELECT_POLICY = "select * from tenant_scheduling_policy where tenant_id = %s"
LOCK_POLICY = SELECT_POLICY + " for update"
SELECT_HISTORY = """select policy_version, policy, operator, reason, created_at from tenant_policy_history
                     where tenant_id = %(t)s and (%(before)s::bigint is null or policy_version < %(before)s)
                     order by policy_version desc limit %(limit)s"""
SELECT_VERSION = "select policy from tenant_policy_history where tenant_id = %s and policy_version = %s"
LATEST_SNAPSHOT = "select * from policy_set_snapshot order by snapshot_id desc limit 1"


def _tenant_uuid(tenant_id: Any) -> UUID:
    try:
        return tenant_id if isinstance(tenant_id, UUID) else UUID(str(tenant_id))
    except ValueError:
        raise NotFound("no such tenant") from None  # a malformed id reads like one that does not exist


def as_doc(row: Mapping[str, Any]) -> dict:
    """A policy row as the CLI prints it and the API answers: every column, versioned."""
    updated = row["updated_at"]
    return {"tenant_id": str(row["tenant_id"]), **settable(row), "policy_version": int(row["policy_version"]),
            "updated_at": updated.isoformat() if isinstance(updated, datetime) else updated}


def show_policy(conn: psycopg.Connection, tenant_id: Any) -> dict:
    row = conn.execute(SELECT_POLICY, (_tenant_uuid(tenant_id),)).fetchone()
    if row is None:
        raise NotFound("no such tenant", details={"tenant_id": str(tenant_id)})
    return as_doc(row)


def _cursor(version: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"v": version}).encode()).decode().rstrip("=")


def _from_cursor(cursor: str | None) -> int | None:
    if not cursor:
        return None
    try:
        v = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))["v"]
        if type(v) is not int:
            raise ValueError
        return v
    except (ValueError, KeyError, TypeError, RecursionError):
        raise InvalidRequest("invalid cursor", {"cursor": "a next_cursor this API returned"}) from None


def policy_history(conn: psycopg.Connection, tenant_id: Any, *, limit: int = 50, cursor: str | None = None) -> dict:
    """Every version of a tenant's policy, newest first: {"items": [...], "next_cursor"}."""
    t = _tenant_uuid(tenant_id)
    if not 1 <= limit <= 500:
        raise InvalidRequest("invalid limit", {"limit": "from 1 to 500"})
    before = _from_cursor(cursor)
    if conn.execute("select 1 from tenant_scheduling_policy where tenant_id = %s", (t,)).fetchone() is None:
        raise NotFound("no such tenant", details={"tenant_id": str(tenant_id)})
    rows = conn.execute(SELECT_HISTORY, {"t": t, "before": before, "limit": limit + 1}).fetchall()
    items = [{"policy_version": int(r["policy_version"]), "policy": r["policy"], "operator": r["operator"],
              "reason": r["reason"], "created_at": r["created_at"].isoformat()} for r in rows[:limit]]
    return {"items": items, "next_cursor": _cursor(items[-1]["policy_version"]) if len(rows) > limit else None}


def policy_at(conn: psycopg.Connection, tenant_id: UUID, version: int) -> dict | None:
    """The policy a tenant had at `version` (tenant_policy_history), or None when unrecorded."""
    row = conn.execute(SELECT_VERSION, (tenant_id, version)).fetchone()
    return row["policy"] if row else None


def admitted_service_class(conn: psycopg.Connection, task: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """The tenant's service class under the version the task was admitted with: the current one when
    it is that version (no read), else the history's (the current one when unrecorded)."""
    if task["policy_version"] == current["policy_version"]:
        return current["service_class"]
    old = policy_at(conn, task["tenant_id"], task["policy_version"])
    return (old or {}).get("service_class") or current["service_class"]


def latest_snapshot(conn: psycopg.Connection) -> dict | None:
    """The last good policy set: {snapshot_id, taken_at, operator, reason, tenant_id, policy_version,
    policies: {tenant_id: policy}}; None before the first change."""
    row = conn.execute(LATEST_SNAPSHOT).fetchone()
    if row is None:
        return None
    return {"snapshot_id": row["snapshot_id"], "taken_at": row["taken_at"].isoformat(), "operator": row["operator"],
            "reason": row["reason"], "tenant_id": str(row["tenant_id"]) if row["tenant_id"] else None,
            "policy_version": row["policy_version"], "tenant_count": row["tenant_count"], "policies": row["policies"]}


# --- changing ----------------------------------------------------------------------------------------

INSERT_HISTORY = """insert into tenant_policy_history (tenant_id, policy_version, policy, operator, reason, created_at)
                    values (%s, %s, %s, %s, %s, %s)"""
SYNC_TENANT_CLASS = """update tenant set service_class = %s, updated_at = %s
                        where tenant_id = %s and service_class is distinct from %s"""
# The whole set as it stands in this transaction (this change included), keyed by tenant.
SNAPSHOT_SET = """insert into policy_set_snapshot (taken_at, operator, reason, tenant_id, policy_version, policies, tenant_count)
                  select %(now)s, %(operator)s, %(reason)s, %(tenant)s, %(version)s,
                         coalesce(jsonb_object_agg(p.tenant_id::text, to_jsonb(p) - 'tenant_id'), '{}'::jsonb), count(*)
                    from tenant_scheduling_policy p
                  returning snapshot_id"""


def _update_statement(names: list[str]) -> str:
    # Column names come from COLUMNS only (check_changes drops every other key).
    sets = ", ".join(f"{n} = %({n})s" for n in names)
    return f"""update tenant_scheduling_policy set {sets}, policy_version = policy_version + 1,
                       updated_at = coalesce(%(now)s::timestamptz, now())
                where tenant_id = %(tenant_id)s returning *"""


def set_policy(conn: psycopg.Connection, *, operator: str, tenant_id: Any, changes: Any, reason: str | None = None,
               config: Any = None, now: datetime | None = None, problems: Mapping[str, str] | None = None) -> dict:
    """Apply `changes` ({column: value}) to a tenant's policy in the caller's transaction and return
    the policy in force. An invalid result raises InvalidRequest naming each bad field (nothing is
    written); an unknown tenant NotFound. `config`: the platform's config, whose lanes with the
    operator's capacity overrides hold reserved_units (default the running platform's); the lanes in
    force are read here, after the policy-set lock, which a lane's capacity change takes too (a read
    before it could miss a change committing meanwhile). `problems`: what the caller found already
    (a CLI flag that did not parse), reported with the rest."""
    if config is None:
        config = get_platform().config
    t = _tenant_uuid(tenant_id)
    typed, bad = check_changes(changes)
    if problems:
        bad = {**{k: v for k, v in bad.items() if k != "changes"}, **problems}
    if not operator:
        bad["operator"] = "an operator name"
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON):
        bad["reason"] = f"text of at most {MAX_REASON} characters"
    conn.execute(POLICY_SET_LOCK)
    lanes = _lanes_in_force(config, conn)
    current = conn.execute(LOCK_POLICY, (t,)).fetchone()
    if current is None:
        raise NotFound("no such tenant", details={"tenant_id": str(tenant_id)})
    merged = {**settable(current), **typed}
    for field, why in validate(merged, lanes=lanes, changed=set(typed)).items():
        bad.setdefault(field, why)
    if bad:
        raise InvalidRequest(f"invalid policy change: {', '.join(sorted(bad))}", bad)

    names = [n for n in NAMES if n in typed]
    row = conn.execute(_update_statement(names), {**typed, "now": now, "tenant_id": t}).fetchone()
    when, version = row["updated_at"], int(row["policy_version"])
    if "service_class" in typed:
        # admission takes the lane from the tenant row (admission.service.tenant_policy): keep them one
        conn.execute(SYNC_TENANT_CLASS, (typed["service_class"], when, t, typed["service_class"]))
    conn.execute(INSERT_HISTORY, (t, version, json.dumps(settable(row)), operator, reason, when))
    # The snapshot (an aggregate over every tenant) before the audit row: the audit insert takes the
    # chain head's lock, which every audited change anywhere waits for until this one commits.
    conn.execute(SNAPSHOT_SET, {"now": when, "operator": operator, "reason": reason, "tenant": t, "version": version})
    _audit(conn, operator=operator, tenant_id=t, old={n: current[n] for n in names}, new={n: row[n] for n in names},
           reason=reason, policy_version=version)
    return as_doc(row)


def _audit(conn, *, operator: str, tenant_id: UUID, old: dict, new: dict, reason: str | None, policy_version: int) -> None:
    audit.append(conn, operator=operator, action="policy.set", target=f"tenant:{tenant_id}", tenant_id=tenant_id,
                 old=old, new=new, reason=reason, policy_version=policy_version)


def _lanes_in_force(config, conn: psycopg.Connection) -> Mapping[str, Any]:
    return capacity.apply_overrides(config, capacity.load_overrides(conn)).lanes


def lanes_in_force(platform, conn: psycopg.Connection) -> Mapping[str, Any]:
    """The lanes as configured with the operator's capacity overrides (aivedio.policy.capacity), read on the
    change's own connection: reserved_units is held against the capacity in force, not the file's.
    A change validates against the lanes it reads under the policy-set lock (set_policy), not these."""
    return _lanes_in_force(platform.config, conn)


def change_policy(platform, *, operator: str, tenant_id: Any, changes: Any, reason: str | None = None) -> dict:
    """set_policy in a transaction of its own, then this process's caches of policy figures dropped."""
    doc = platform.db.transaction(lambda conn: set_policy(
        conn, operator=operator, tenant_id=tenant_id, changes=changes, reason=reason, config=platform.config,
        now=platform.clock.now()))
    invalidate_caches(platform)
    return doc


POLICY_EPOCH = "policy_epoch"


def invalidate_caches(platform) -> None:
    """Drop what this process derived from policies: admission's policies and lane figures (active
    weights), cached ~1 s, and the scheduler's heaviest weight (cached a minute; it watches the
    epoch). Other processes see a change within those same bounds, except that an admission is
    never written under a policy that has changed (aivedio_admit checks its version); nothing
    policy-derived lives in Redis (the token buckets take their rate from the policy in use)."""
    for name in ("admission_cache", "admission_policies"):
        cache = platform.extras.get(name)
        if cache is not None:
            cache.clear()
    platform.extras[POLICY_EPOCH] = platform.extras.get(POLICY_EPOCH, 0) + 1
