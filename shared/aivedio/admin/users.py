"""Another user of a tenant (docs/cli.md `aivedio admin user create`): a user row and its
own API key, shown once. A user's limits are the tenant policy's per-user columns
(max_user_running_tasks, max_user_queued_tasks, user_submit_rate_per_minute, ...), applied to that
user alone: its own running counters (the claim's `user:` keys), its own queued counts at admission
and its own rate bucket, so one user at its cap never holds up the tenant's others. Audited in the
transaction that makes the user; the key's secret is never audited or stored."""
from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

import psycopg

from aivedio import audit, auth
from aivedio.errors import InvalidRequest, NotFound

USER_ROLES = ("MEMBER", "OWNER")

INSERT_USER = "insert into app_user (tenant_id, name, role) values (%s, %s, %s) returning user_id, name, role"


@dataclass(frozen=True)
class CreatedUser:
    tenant_id: UUID
    user_id: UUID
    role: str
    name: str
    key_id: UUID
    api_key: str

    def as_dict(self) -> dict:
        return {"tenant_id": str(self.tenant_id), "user_id": str(self.user_id), "role": self.role, "name": self.name,
                "key_id": str(self.key_id), "api_key": self.api_key}


def create_user(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, role: str = "MEMBER",
                name: str | None = None) -> CreatedUser:
    if role not in USER_ROLES:
        raise InvalidRequest("unknown user role", {"role": f"one of {', '.join(USER_ROLES)}"})
    if name is not None and not (1 <= len(name) <= 200 and name.strip()):
        raise InvalidRequest("a user name is 1 to 200 characters", {"name": "1 to 200 characters"})
    if conn.execute("select 1 from tenant where tenant_id = %s", (tenant_id,)).fetchone() is None:
        raise NotFound(f"no tenant {tenant_id}", details={"tenant_id": str(tenant_id)})
    row = conn.execute(INSERT_USER, (tenant_id, name or f"{role.lower()}-{tenant_id.hex[:6]}", role)).fetchone()
    issued = auth.issue_key(conn, tenant_id, row["user_id"])
    audit.append(conn, operator=operator, action="user.create", target=f"user:{row['user_id']}", tenant_id=tenant_id,
                 new={"role": role, "name": row["name"], "key_id": issued.key_id, "key_prefix": issued.secret[:8]})
    return CreatedUser(tenant_id, row["user_id"], role, row["name"], issued.key_id, issued.secret)
