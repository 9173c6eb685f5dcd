"""Issuing API keys for an existing tenant: a project key attributes the work it submits to one of
the tenant's projects, which the claim then reserves against the PROJECT budget (ch. 20.9.4). The
project is the operator's choice, never the client's (the tenant API has no field for it). Under
RBAC and audit like every admin write; the secret is returned once and never audited or stored."""
from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

import psycopg

from aivedio import auth
from aivedio.admin import rbac
from aivedio.billing.budgets import project_scope_id
from aivedio.errors import NotFound

FIRST_OWNER = """
select user_id from app_user where tenant_id = %s and role = 'OWNER' order by created_at, user_id limit 1
"""


@dataclass(frozen=True)
class CreatedKey:
    key_id: UUID
    tenant_id: UUID
    user_id: UUID
    project: str
    api_key: str

    def as_dict(self) -> dict:
        return {"key_id": str(self.key_id), "tenant_id": str(self.tenant_id), "user_id": str(self.user_id),
                "project": self.project, "api_key": self.api_key,
                "budget_scope_id": project_scope_id(self.tenant_id, self.project)}  # for `admin budget set --scope-type PROJECT`


def create_api_key(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, project: str,
                   user_id: UUID | None = None) -> CreatedKey:
    """A new key of `user_id` (default: the tenant's first OWNER) bound to `project`."""
    rbac.require(conn, operator, "api_key.create")
    auth.validate_project(project)
    if conn.execute("select 1 from tenant where tenant_id = %s", (tenant_id,)).fetchone() is None:
        raise NotFound(f"no tenant {tenant_id}", details={"tenant_id": str(tenant_id)})
    if user_id is None:
        owner = conn.execute(FIRST_OWNER, (tenant_id,)).fetchone()
        if owner is None:
            raise NotFound(f"tenant {tenant_id} has no OWNER user: name the key's user", details={"user_id": "required"})
        user_id = owner["user_id"]
    elif conn.execute("select 1 from app_user where tenant_id = %s and user_id = %s", (tenant_id, user_id)).fetchone() is None:
        raise NotFound(f"no user {user_id} in tenant {tenant_id}", details={"user_id": str(user_id)})
    issued = auth.issue_key(conn, tenant_id, user_id, project=project)
    rbac.audit(conn, operator=operator, action="api_key.create", target=f"api_key:{issued.key_id}", tenant_id=tenant_id,
               new={"user_id": user_id, "project": project, "key_prefix": issued.secret[:8]})
    return CreatedKey(issued.key_id, tenant_id, user_id, project, issued.secret)
