"""Creating tenants (docs/operations.md): the tenant with its scheduling policy, its first
user, a wallet whose credits arrive as a paid credit lot through a GRANT, and an API key shown once."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

from aivedio import auth
from aivedio.billing.lots import grant_credits
from aivedio.config import SERVICE_CLASSES
from aivedio.errors import Conflict, InvalidRequest
from aivedio.policy import tenant_policy as policies
from aivedio.views import decode_cursor, encode_cursor

# Contract defaults per service class (ch. 18.5.1 examples); operators change them per tenant.
POLICY_DEFAULTS: dict[str, dict] = {
    "ENTERPRISE_RESERVED": dict(max_queued_tasks=5000, max_queued_units=20000, max_running_tasks=100, max_running_units=240,
                                max_cost_per_minute=5000, max_cost_per_day=2_000_000, reserved_units=200, burst_units=100,
                                max_wait_seconds=1800, max_user_queued_tasks=500, max_user_queued_units=2000,
                                max_user_running_tasks=20, max_user_running_units=60, user_submit_rate_per_minute=120,
                                tenant_submit_rate_per_minute=1200, cancel_rate_per_minute=120,
                                allow_best_effort_downgrade=False, expensive_allowed=True),
    "PAID_SHARED": dict(max_queued_tasks=5000, max_queued_units=12000, max_running_tasks=100, max_running_units=240,
                        max_cost_per_minute=1000, max_cost_per_day=500_000, reserved_units=0, burst_units=40,
                        max_wait_seconds=1800, max_user_queued_tasks=20, max_user_queued_units=100,
                        max_user_running_tasks=2, max_user_running_units=24, user_submit_rate_per_minute=5,
                        tenant_submit_rate_per_minute=100, cancel_rate_per_minute=30,
                        allow_best_effort_downgrade=True, expensive_allowed=True),
    "STANDARD": dict(max_queued_tasks=1000, max_queued_units=4000, max_running_tasks=20, max_running_units=60,
                     max_cost_per_minute=300, max_cost_per_day=100_000, reserved_units=0, burst_units=10,
                     max_wait_seconds=3600, max_user_queued_tasks=20, max_user_queued_units=100,
                     max_user_running_tasks=2, max_user_running_units=24, user_submit_rate_per_minute=5,
                     tenant_submit_rate_per_minute=100, cancel_rate_per_minute=30,
                     allow_best_effort_downgrade=True, expensive_allowed=False),
    "BEST_EFFORT": dict(max_queued_tasks=200, max_queued_units=600, max_running_tasks=10, max_running_units=20,
                        max_cost_per_minute=100, max_cost_per_day=20_000, reserved_units=0, burst_units=4,
                        max_wait_seconds=7200, max_user_queued_tasks=10, max_user_queued_units=40,
                        max_user_running_tasks=1, max_user_running_units=8, user_submit_rate_per_minute=5,
                        tenant_submit_rate_per_minute=30, cancel_rate_per_minute=30,
                        allow_best_effort_downgrade=False, expensive_allowed=False),
}
ACCOUNT_TYPES = ("PREPAID", "SUBSCRIPTION", "POSTPAID")
SUBSCRIPTION_PERIOD = timedelta(days=30)


def initial_burst_credit(config, weight: int) -> int:
    """ch. 18.6.4: the deficit a tenant coming back from empty may start from: two of its quanta."""
    return 2 * config.scheduler.base_quantum * weight


@dataclass(frozen=True)
class CreatedTenant:
    tenant_id: UUID
    user_id: UUID
    wallet_id: UUID
    api_key: str

    def as_dict(self) -> dict:
        return {"tenant_id": str(self.tenant_id), "user_id": str(self.user_id), "api_key": self.api_key,
                "wallet_id": str(self.wallet_id)}


def create_tenant(platform, *, name: str, service_class: str, weight: int, credits: int = 0,
                  account_type: str = "PREPAID", operator: str = "cli", policy_overrides: dict | None = None,
                  trusted: bool = False) -> CreatedTenant:
    """Create a tenant with the class's default policy and `policy_overrides` over it. The policy is
    held to the rules of a policy change (policy.tenant_policy: each column's type and bounds, the caps'
    order, reserved_units within the lane's capacity in force), so a created policy can be changed
    later; a bad one raises InvalidRequest naming each field (policy.<column>), having written
    nothing. `trusted`: no policy validation, for the platform's own fixtures only (the simulator
    and the tests, whose policies open limits far past an operator's bounds or reserve more than a
    small test lane holds); the admin API and the CLI never pass it."""
    bad = {}
    if not isinstance(name, str) or not name or len(name) > 128:
        bad["name"] = "1 to 128 characters"
    if service_class not in SERVICE_CLASSES:
        bad["service_class"] = f"one of {', '.join(SERVICE_CLASSES)}"
    if type(weight) is not int or weight < 1 or weight > 1000:
        bad["weight"] = "an integer from 1 to 1000"
    if type(credits) is not int or credits < 0:
        bad["credits"] = "a non-negative integer"
    if account_type not in ACCOUNT_TYPES:
        bad["account_type"] = f"one of {', '.join(ACCOUNT_TYPES)}"
    if policy_overrides is not None and not isinstance(policy_overrides, dict):
        bad["policy"] = "an object of column: value"
        policy_overrides = None
    overrides = dict(policy_overrides or {})
    unknown = set(overrides) - set(POLICY_DEFAULTS["STANDARD"]) - {"burst_rounds", "initial_burst_credit"}
    if unknown:
        bad["policy"] = f"unknown policy keys: {sorted(unknown)}"
    if overrides and not trusted:
        _, wrong = policies.check_changes({k: v for k, v in overrides.items() if k not in unknown})
        bad.update({f"policy.{k}": why for k, why in wrong.items() if k != "changes"})
    if bad:
        raise InvalidRequest("invalid tenant", bad)
    policy = {**POLICY_DEFAULTS.get(service_class, {}), **overrides}
    policy.setdefault("burst_rounds", 4)
    policy.setdefault("initial_burst_credit", initial_burst_credit(platform.config, weight))

    def check(conn) -> None:
        """The whole policy against the rules of a change, and reserved_units against the lanes in
        force, read under the policy-set lock that a lane's capacity change takes too."""
        conn.execute(policies.POLICY_SET_LOCK)
        lanes = policies.lanes_in_force(platform, conn)
        wrong = policies.validate({"service_class": service_class, "weight": weight, **policy}, lanes=lanes,
                                  changed=set(overrides))
        if wrong:
            fields = {(k if k in ("service_class", "weight") else f"policy.{k}"): why for k, why in wrong.items()}
            raise InvalidRequest(f"invalid tenant policy: {', '.join(sorted(fields))}", fields)

    def tx(conn) -> CreatedTenant:
        if not trusted:
            check(conn)
        now = platform.clock.now()
        row = conn.execute("insert into tenant (name, service_class) values (%s, %s) on conflict (name) do nothing returning tenant_id",
                           (name, service_class)).fetchone()
        if row is None:
            raise Conflict(f"a tenant named {name!r} exists", code="TENANT_EXISTS")
        tenant_id = row["tenant_id"]
        cols = ["tenant_id", "service_class", "weight", "policy_version", "updated_at", *policy]
        conn.execute(
            f"insert into tenant_scheduling_policy ({', '.join(cols)}) values ({', '.join(['%s'] * len(cols))})",
            (tenant_id, service_class, weight, 1, now, *policy.values()),
        )
        conn.execute(
            "insert into tenant_policy_history (tenant_id, policy_version, policy, operator, reason) values (%s, 1, %s, %s, 'tenant created')",
            (tenant_id, json.dumps({"service_class": service_class, "weight": weight, **policy}), operator),
        )
        user_id = conn.execute("insert into app_user (tenant_id, name, role) values (%s, %s, 'OWNER') returning user_id",
                               (tenant_id, f"{name}-owner")).fetchone()["user_id"]
        wallet = conn.execute(
            """insert into wallet_account (tenant_id, account_type, unit_code, credit_limit_amount)
               values (%s, %s, 'CREDIT', %s) returning *""",
            (tenant_id, account_type, credits if account_type == "POSTPAID" else 0),
        ).fetchone()
        if credits and account_type != "POSTPAID":
            grant_credits(conn, wallet, credits, kind="PAID" if account_type == "PREPAID" else "SUBSCRIPTION",
                          business_key=f"grant:initial:{tenant_id}",
                          expires_at=now + SUBSCRIPTION_PERIOD if account_type == "SUBSCRIPTION" else None)
        secret = auth.issue_key(conn, tenant_id, user_id).secret
        conn.execute(
            "insert into audit_log (tenant_id, operator, action, target, new_value, reason, policy_version) values (%s, %s, %s, %s, %s, %s, 1)",
            (tenant_id, operator, "tenant.create", f"tenant:{tenant_id}",
             json.dumps({"name": name, "service_class": service_class, "weight": weight, "credits": credits,
                         "account_type": account_type}), "tenant created"),
        )
        return CreatedTenant(tenant_id, user_id, wallet["wallet_id"], secret)

    return platform.db.transaction(tx)


# --- the admin API's tenant list (docs/admin-api.md) -------------------------------------------------

# The policy in force names the tenant's class and weight (a policy change moves them, not tenant's row).
LIST_TENANTS = """
select t.tenant_id, t.name, t.status, t.created_at, p.service_class, p.weight, p.policy_version
  from tenant t
  join tenant_scheduling_policy p on p.tenant_id = t.tenant_id
 where %(after_ts)s::timestamptz is null or (t.created_at, t.tenant_id) > (%(after_ts)s, %(after_id)s::uuid)
 order by t.created_at, t.tenant_id
 limit %(limit)s
"""


def list_tenants(conn, *, limit: int, cursor: str | None = None) -> dict:
    """Tenants, oldest first, a page of `limit` after `cursor` (views.encode_cursor of the last one)."""
    after_ts, after_id = decode_cursor(cursor) if cursor else (None, None)
    rows = conn.execute(LIST_TENANTS, {"after_ts": after_ts, "after_id": after_id, "limit": limit + 1}).fetchall()
    page = rows[:limit]
    return {"items": [{"tenant_id": str(r["tenant_id"]), "name": r["name"], "service_class": r["service_class"],
                       "weight": r["weight"], "policy_version": r["policy_version"], "status": r["status"],
                       "created_at": r["created_at"].isoformat()} for r in page],
            "next_cursor": encode_cursor(page[-1]["created_at"], page[-1]["tenant_id"]) if len(rows) > limit else None}
