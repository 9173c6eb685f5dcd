"""Provider spend budgets (ch. 20.5.6, 20.6.3, 20.9.4): reserve, settle and release, like credit.

A budget_account limits the provider money (Decimal, one currency) spent in a period at one scope:
TENANT, PROJECT, PROVIDER_ACCOUNT, MODEL, REGION or GLOBAL. Before an attempt may cost money its
estimated cost is reserved against every budget of its scopes, in one transaction, under the
budgets' row locks (taken in budget_id order, so concurrent reservations never deadlock). The
attempt's actual cost settles the reservation later (consumed += actual, reserved -= estimate);
an attempt that cost nothing releases it. A new attempt reserves anew: an old one's reservation is
never reused, because that attempt may still be billed.

Thresholds, of (reserved + consumed + this amount) / limit (BillingConfig):
- budget_alert_pct (70 %): an alert, logged once per budget and level;
- budget_restrict_pct (90 %): costly or low-priority work is refused;
- budget_reject_pct (100 %): work that would take the budget past it is refused, so a full budget
  refuses everything (callers queue it or route it elsewhere);
- the abnormal-slope breaker: refused when more than budget_slope_max_fraction of the limit was
  reserved within budget_slope_window_seconds, even far below the limit.
A refusal raises BudgetExceeded inside the caller's transaction, so nothing is written.

A PROJECT budget's scope id is tenant-qualified (project_scope_id): a project is named by the
operator on the tenant's API keys, and two tenants may both have a project called "trailers".

A budget in another currency than the amount is never summed with it: a scope whose only budgets
are in other currencies raises CurrencyMismatch. PostgreSQL decides; a Redis mirror of burn rates
may pre-filter but never overrules it."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from uuid import UUID

import psycopg

from aivedio import audit
from aivedio.auth import validate_project
from aivedio.cache.client import CacheUnavailable
from aivedio.caching import cached
from aivedio.config import BillingConfig
from aivedio.errors import Conflict, DomainError, InvalidRequest, NotFound
from aivedio.metrics_catalog import BUDGET_ALERTS, BUDGET_REFUSALS
from aivedio.observability import logger, publish


class BudgetExceeded(DomainError):
    """A budget at or above its reject threshold, or restricting this kind of work, or its
    abnormal-slope breaker tripped. `details` names the budget and the level."""

    code = "BUDGET_EXCEEDED"


class CurrencyMismatch(Conflict):
    """Two amounts in different currencies: rejected, never summed."""

    code = "CURRENCY_MISMATCH"


SCOPES = ("TENANT", "PROJECT", "PROVIDER_ACCOUNT", "MODEL", "REGION", "GLOBAL")
QUANTUM = Decimal("0.00000001")

BUDGETS_OF_SCOPES = """
select * from budget_account
 where (scope_type, scope_id) in (select * from unnest(%(types)s::text[], %(ids)s::text[]))
   and period_start <= %(now)s and period_end > %(now)s
"""
LOCK_BUDGETS = BUDGETS_OF_SCOPES + " order by budget_id for update"

WINDOW_RESERVED = """
select coalesce(sum(amount), 0) as n from budget_reservation where budget_id = %s and created_at > %s
"""


@dataclass(frozen=True)
class BudgetCheck:
    level: int  # the highest threshold reached: 0, alert, restrict (never reject: that raises)
    reserved: tuple[UUID, ...] = ()  # budgets reserved against
    alerts: tuple[str, ...] = field(default_factory=tuple)


def project_scope_id(tenant_id: UUID, project: str) -> str:
    """The PROJECT scope id of a tenant's project: the one spelling admission, the claim and
    set_budget all use, so a tenant's tasks only ever reach its own project budgets."""
    return f"{tenant_id}:{project}"


def _project_tenant(scope_id: str) -> UUID | None:
    """The tenant of a PROJECT scope id, or None when the id is not project_scope_id's spelling."""
    tenant, _, project = scope_id.partition(":")
    try:
        tenant_id = UUID(tenant)
        validate_project(project)
    except (ValueError, InvalidRequest):
        return None
    return tenant_id if project_scope_id(tenant_id, project) == scope_id else None


def set_budget(conn: psycopg.Connection, *, operator: str, scope_type: str, scope_id: str, period_start: datetime,
               period_end: datetime, limit_amount: Decimal, currency: str, tenant_id: UUID | None = None) -> dict:
    bad = {}
    if scope_type not in SCOPES:
        bad["scope_type"] = f"one of {', '.join(SCOPES)}"
    if not scope_id:
        bad["scope_id"] = "required (GLOBAL uses '*')"
    if period_end <= period_start:
        bad["period_end"] = "after period_start"
    if Decimal(limit_amount) < 0:
        bad["limit_amount"] = "not negative"
    if not currency:
        bad["currency"] = "required"
    if scope_type == "PROJECT" and scope_id:
        # A budget under any other spelling would never be reserved against: refuse it here.
        owner = _project_tenant(scope_id)
        if owner is None:
            bad["scope_id"] = "TENANT_ID:PROJECT for a PROJECT budget (the tenant's uuid, a colon, the key's project)"
        elif tenant_id is not None and tenant_id != owner:
            bad["tenant_id"] = f"the PROJECT scope's tenant, {owner}"
        else:
            tenant_id = owner
    if bad:
        raise InvalidRequest("invalid budget", bad)
    if scope_type == "PROJECT" and conn.execute("select 1 from tenant where tenant_id = %s", (tenant_id,)).fetchone() is None:
        raise NotFound(f"no tenant {tenant_id}", details={"tenant_id": str(tenant_id)})
    row = conn.execute(
        """insert into budget_account (scope_type, scope_id, tenant_id, period_start, period_end, limit_amount, currency)
           values (%s, %s, %s, %s, %s, %s, %s)
           on conflict (scope_type, scope_id, period_start, period_end, currency)
           do update set limit_amount = excluded.limit_amount, version = budget_account.version + 1, updated_at = now()
           returning *""",
        (scope_type, scope_id, tenant_id, period_start, period_end, Decimal(limit_amount), currency)).fetchone()
    audit.append(conn, operator=operator, action="budget.set", target=f"budget:{row['budget_id']}", tenant_id=tenant_id,
                 new={"scope": f"{scope_type}:{scope_id}", "limit": str(limit_amount), "currency": currency,
                      "period": [period_start.isoformat(), period_end.isoformat()]})
    return dict(row)


def usage_pct(budget: dict, extra: Decimal = Decimal(0)) -> Decimal:
    limit = Decimal(budget["limit_amount"])
    used = Decimal(budget["reserved_amount"]) + Decimal(budget["consumed_amount"]) + extra
    if limit <= 0:
        return Decimal("Infinity") if used > 0 else Decimal(0)
    return used * 100 / limit


def reserve(conn: psycopg.Connection, *, scopes: list[tuple[str, str]], amount: Decimal, currency: str, business_key: str,
            now: datetime, config: BillingConfig, attempt_id: UUID | None = None, task_id: UUID | None = None,
            tenant_id: UUID | None = None, costly: bool = False, low_priority: bool = False) -> BudgetCheck:
    """Reserve `amount` against every budget of `scopes` in force at `now`, or raise BudgetExceeded.
    Idempotent per (business_key, budget): a retried reservation adds nothing."""
    amount = Decimal(amount).quantize(QUANTUM)
    if amount < 0:
        raise InvalidRequest("a budget reservation is not negative", {"amount": "not negative"})
    if not scopes:
        return BudgetCheck(0)
    budgets = conn.execute(LOCK_BUDGETS, {"types": [s for s, _ in scopes], "ids": [i for _, i in scopes], "now": now}).fetchall()
    mine = [b for b in budgets if b["currency"] == currency]
    others = {(b["scope_type"], b["scope_id"]) for b in budgets} - {(b["scope_type"], b["scope_id"]) for b in mine}
    if others:
        raise CurrencyMismatch(f"budgets of {sorted(others)} are not in {currency}", details={"currency": currency})
    level, alerts, reserved = 0, [], []
    window_start = now - timedelta(seconds=config.budget_slope_window_seconds)
    for b in mine:
        key = f"{business_key}:{b['budget_id']}"
        if conn.execute("select 1 from budget_reservation where business_key = %s", (key,)).fetchone():
            reserved.append(b["budget_id"])
            continue
        why, details = refusal_of(conn, b, amount=amount, currency=currency, window_start=window_start, config=config,
                                  costly=costly, low_priority=low_priority)
        if why is not None:
            _refused(b, why, details)
        pct = usage_pct(b, amount)
        reached = max([t for t in (config.budget_alert_pct, config.budget_restrict_pct) if pct >= t], default=0)
        level = max(level, reached)
        if reached and reached > b["alert_level"]:
            conn.execute("update budget_account set alert_level = %s where budget_id = %s", (reached, b["budget_id"]))
            alerts.append(f"{b['scope_type']}:{b['scope_id']}>={reached}%")
            publish(BUDGET_ALERTS, scope=b["scope_type"], level=str(reached))
            logger.warning("budget threshold reached", extra={**details, "threshold_pct": reached})
        conn.execute(
            """insert into budget_reservation (budget_id, tenant_id, attempt_id, task_id, business_key, amount, created_at, updated_at)
               values (%s, %s, %s, %s, %s, %s, %s, %s)""",
            (b["budget_id"], tenant_id, attempt_id, task_id, key, amount, now, now))
        conn.execute("update budget_account set reserved_amount = reserved_amount + %s, version = version + 1, updated_at = %s "
                     "where budget_id = %s", (amount, now, b["budget_id"]))
        reserved.append(b["budget_id"])
    return BudgetCheck(level, tuple(reserved), tuple(alerts))


def refusal_of(conn: psycopg.Connection, b: dict, *, amount: Decimal, currency: str, window_start: datetime,
               config: BillingConfig, costly: bool, low_priority: bool) -> tuple[str | None, dict]:
    """Whether budget `b` refuses a reservation of `amount`: (REJECT | RESTRICT | SLOPE_BREAKER, details),
    or (None, details). The one statement of the rule: reserve() and would_refuse() both ask it."""
    pct = usage_pct(b, amount)
    details = {"budget_id": str(b["budget_id"]), "scope": f"{b['scope_type']}:{b['scope_id']}",
               "usage_pct": str(pct.quantize(Decimal("0.01")) if pct.is_finite() else pct), "currency": currency}
    if pct > config.budget_reject_pct:
        return "REJECT", details
    if pct >= config.budget_restrict_pct and (costly or low_priority):
        return "RESTRICT", details
    recent = Decimal(conn.execute(WINDOW_RESERVED, (b["budget_id"], window_start)).fetchone()["n"]) + amount
    if recent > Decimal(b["limit_amount"]) * Decimal(str(config.budget_slope_max_fraction)):
        return "SLOPE_BREAKER", {**details, "window_reserved": str(recent)}
    return None, details


def would_refuse(conn: psycopg.Connection, *, scopes: list[tuple[str, str]], amount: Decimal, currency: str, now: datetime,
                 config: BillingConfig, costly: bool = False, low_priority: bool = False) -> dict | None:
    """What reserve() would refuse, read without a lock or a write (aivedio.scheduling.why_waiting):
    the refusing budget's details with `why`, or None when every budget of `scopes` takes `amount`."""
    amount = Decimal(amount).quantize(QUANTUM)
    if not scopes:
        return None
    rows = conn.execute(BUDGETS_OF_SCOPES + " order by budget_id",
                        {"types": [s for s, _ in scopes], "ids": [i for _, i in scopes], "now": now}).fetchall()
    mine = [b for b in rows if b["currency"] == currency]
    if {(b["scope_type"], b["scope_id"]) for b in rows} - {(b["scope_type"], b["scope_id"]) for b in mine}:
        return {"scope": "", "why": "CURRENCY_MISMATCH", "currency": currency}  # reserve()'s CurrencyMismatch names no scope
    window_start = now - timedelta(seconds=config.budget_slope_window_seconds)
    for b in mine:
        why, details = refusal_of(conn, b, amount=amount, currency=currency, window_start=window_start, config=config,
                                  costly=costly, low_priority=low_priority)
        if why is not None:
            return {**details, "why": why}
    return None


def _refused(budget: dict, why: str, details: dict) -> None:
    publish(BUDGET_REFUSALS, scope=budget["scope_type"], reason=why)
    logger.warning("budget refused work", extra={**details, "why": why})
    raise BudgetExceeded(f"budget {details['scope']} refuses new work ({why}, {details['usage_pct']}% used)",
                         details={**details, "why": why})


LOCK_ATTEMPT_BUDGETS = """
select 1 from budget_account where budget_id in (select budget_id from budget_reservation
                                                  where attempt_id = %(attempt_id)s and state = 'ACTIVE')
 order by budget_id for update
"""

# Both statements need no answer (they travel in settlement's pipeline); the budgets were locked in
# budget_id order first, as reserve() locks them, so settlements and reservations never deadlock.
SETTLE_ATTEMPT = """
with r as (
    update budget_reservation br
       set settled_amount = least(%(actual)s, br.amount), released_amount = br.amount - least(%(actual)s, br.amount),
           state = 'SETTLED', updated_at = %(now)s
      from budget_account b
     where br.budget_id = b.budget_id and br.attempt_id = %(attempt_id)s and br.state = 'ACTIVE' and b.currency = %(currency)s
    returning br.budget_id, br.amount)
update budget_account b
   set reserved_amount = b.reserved_amount - r.amount, consumed_amount = b.consumed_amount + %(actual)s,
       version = b.version + 1, updated_at = %(now)s
  from r where b.budget_id = r.budget_id
"""

# Released: every ACTIVE reservation of the attempt (currency null), or those whose budget is in
# another currency than the actual cost (never summed with it).
RELEASE_ATTEMPT = """
with r as (
    update budget_reservation br
       set settled_amount = 0, released_amount = br.amount, state = 'RELEASED', updated_at = %(now)s
      from budget_account b
     where br.budget_id = b.budget_id and br.attempt_id = %(attempt_id)s and br.state = 'ACTIVE'
       and (%(currency)s::text is null or b.currency <> %(currency)s)
    returning br.budget_id, br.amount)
update budget_account b
   set reserved_amount = b.reserved_amount - r.amount, version = b.version + 1, updated_at = %(now)s
  from r where b.budget_id = r.budget_id
"""


def settle_attempt(conn: psycopg.Connection, *, attempt_id: UUID, actual: Decimal, currency: str, now: datetime) -> None:
    """Settle the attempt's ACTIVE budget reservations with its actual cost (consumed += actual,
    reserved -= the estimate); a budget in another currency is released instead, never summed."""
    args = {"attempt_id": attempt_id, "actual": Decimal(actual).quantize(QUANTUM), "currency": currency, "now": now}
    conn.execute(LOCK_ATTEMPT_BUDGETS, args)
    conn.execute(SETTLE_ATTEMPT, args)
    conn.execute(RELEASE_ATTEMPT, args)


def release_attempt(conn: psycopg.Connection, *, attempt_id: UUID, now: datetime) -> None:
    """The attempt cost nothing (never submitted, or rejected without charge): release its budget."""
    args = {"attempt_id": attempt_id, "currency": None, "now": now}
    conn.execute(LOCK_ATTEMPT_BUDGETS, args)
    conn.execute(RELEASE_ATTEMPT, args)


def status(conn: psycopg.Connection, *, now: datetime, config: BillingConfig) -> list[dict]:
    """Every budget in force, with its usage and threshold level."""
    out = []
    for b in conn.execute("select * from budget_account where period_start <= %s and period_end > %s order by scope_type, scope_id",
                          (now, now)).fetchall():
        pct = usage_pct(b)
        level = max([t for t in (config.budget_alert_pct, config.budget_restrict_pct, config.budget_reject_pct) if pct >= t],
                    default=0)
        out.append({"budget_id": str(b["budget_id"]), "scope": f"{b['scope_type']}:{b['scope_id']}", "currency": b["currency"],
                    "limit": str(b["limit_amount"]), "reserved": str(b["reserved_amount"]), "consumed": str(b["consumed_amount"]),
                    "usage_pct": str(pct.quantize(Decimal("0.01"))) if pct.is_finite() else "Infinity", "level": level})
    return out


# --- where budgets act: admission (tenant, project, platform) and the claim (every scope) -----------

GLOBAL_SCOPE_ID = "*"
LOW_PRIORITY_BAND = 4  # P4 (best-effort work) is what a budget at its restrict level refuses, with costly work
IN_FORCE = "select exists(select 1 from budget_account where period_start <= %s and period_end > %s) as e"


def in_force(platform, conn=None) -> bool:
    """Whether any budget is in force, cached for a moment per process: with none (the usual
    case) admission and the claim pay nothing for budgets. `conn`: the caller's transaction, read
    on when the cache is stale (a claim holding shard locks must not wait for the pool)."""
    def load() -> bool:
        now = platform.clock.now()
        with (nullcontext(conn) if conn is not None else platform.db.connection()) as c:
            return bool(c.execute(IN_FORCE, (now, now)).fetchone()["e"])

    return cached(platform, "budgets_in_force", load)


def _owner_scopes(tenant_id: UUID, project: str | None) -> list[tuple[str, str]]:
    """The tenant's scope, and its project's when the work has one (the project of the caller's key)."""
    scopes = [("TENANT", str(tenant_id))]
    if project is not None:
        scopes.append(("PROJECT", project_scope_id(tenant_id, project)))
    return scopes


def attempt_scopes(tenant_id: UUID, provider: str, account: str, model: str, region: str | None, *,
                   project: str | None = None) -> list[tuple[str, str]]:
    """The scopes an attempt's provider spend counts against."""
    return [*_owner_scopes(tenant_id, project), ("PROVIDER_ACCOUNT", f"{provider}:{account}"), ("MODEL", model),
            ("REGION", region or ""), ("GLOBAL", GLOBAL_SCOPE_ID)]


def admission_scopes(tenant_id: UUID, project: str | None = None) -> list[tuple[str, str]]:
    """The scopes admission answers to: the tenant's own (and its project's) and the platform's."""
    return [*_owner_scopes(tenant_id, project), ("GLOBAL", GLOBAL_SCOPE_ID)]


def admission_budgets(conn: psycopg.Connection, tenant_id: UUID, now: datetime, *, project: str | None = None) -> list[dict]:
    """The budgets in force at the admission scopes."""
    scopes = admission_scopes(tenant_id, project)
    return conn.execute(BUDGETS_OF_SCOPES, {"types": [s for s, _ in scopes], "ids": [i for _, i in scopes], "now": now}).fetchall()


def refusal(rows: list[dict], *, config: BillingConfig, costly: bool, low_priority: bool) -> str | None:
    """Why admission must refuse new work of this kind (None: it may come in). The claim reserves
    against every scope later; this stops work that could never be claimed from queueing up."""
    for b in rows:
        pct = usage_pct(b)
        if pct >= config.budget_reject_pct:
            return f"the {b['scope_type'].lower()} budget is spent ({pct:.0f}%)"
        if pct >= config.budget_restrict_pct and (costly or low_priority):
            return f"the {b['scope_type'].lower()} budget is at {pct:.0f}%: costly and low-priority work waits"
    return None


# --- the burn-rate mirror in Redis ---------------------------------------------------------------------
# Each scope's budgets as PostgreSQL last showed them (usage of the limit), kept a few seconds. It
# only spares admission a query: a fresh mirror that shows every budget of the admission scopes
# (tenant, project, platform) below the restrict level lets the request through unchecked;
# anything else (missing, stale, near a threshold, Redis down) is decided by PostgreSQL, which also
# refreshes the mirror.
# The claim always reserves in PostgreSQL, so a mirror that lags can never overspend a budget.

MIRROR_TTL_SECONDS = 5


def _mirror_key(cache, scope_type: str, scope_id: str) -> str:
    return cache.key("budget-burn", scope_type, scope_id)


def mirror_write(cache, scope_type: str, scope_id: str, rows: list[dict]) -> None:
    mine = [b for b in rows if (b["scope_type"], b["scope_id"]) == (scope_type, scope_id)]
    worst = max((float(usage_pct(b)) for b in mine), default=0.0)
    try:
        cache.run(cache.r.set, _mirror_key(cache, scope_type, scope_id), f"{worst:.4f}", ex=MIRROR_TTL_SECONDS)
    except CacheUnavailable:
        pass


def mirror_clear(cache, tenant_id: UUID, config: BillingConfig, *, project: str | None = None) -> bool:
    """True when the mirror alone shows every budget of the admission scopes below the restrict
    level; False means: ask PostgreSQL."""
    def read() -> list:
        # GETs in one pipeline, not MGET: the platform scope's key is every tenant's, so the keys
        # cannot share a hash slot, and on a cluster the pipeline asks each node its own keys.
        pipe = cache.r.pipeline(transaction=False)
        for scope in admission_scopes(tenant_id, project):
            pipe.get(_mirror_key(cache, *scope))
        return pipe.execute()

    try:
        values = cache.run(read)
    except CacheUnavailable:
        return False
    return all(v is not None and float(v) < config.budget_restrict_pct for v in values)


def check_admission(platform, *, tenant_id: UUID, costly: bool, low_priority: bool, project: str | None = None) -> str | None:
    """refusal() of the admission budgets, through the mirror: Redis speeds the usual answer up,
    PostgreSQL decides."""
    config = platform.config.billing
    if platform.cache is not None and mirror_clear(platform.cache, tenant_id, config, project=project):
        return None
    with platform.db.connection() as conn:
        rows = admission_budgets(conn, tenant_id, platform.clock.now(), project=project)
    if platform.cache is not None:
        for scope in admission_scopes(tenant_id, project):
            mirror_write(platform.cache, *scope, rows)
    return refusal(rows, config=config, costly=costly, low_priority=low_priority)
