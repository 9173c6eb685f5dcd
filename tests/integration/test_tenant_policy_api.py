"""The admin API's policy routes (docs/admin-api.md) over the real handler behind the local
HTTP server: GET/PATCH /admin/v1/tenants/{id}/policy and GET .../policy/history.

- every role reads (policy.read); only operator and admin change (policy.write); viewer and finance
  are 403 and the denied attempt is audited, with the policy unchanged;
- a PATCH answers 200 with the new policy (policy_version + 1), audited as the operator's name;
- an invalid result is 422 naming each field in details.fields, and the policy stays as it was;
- an unknown tenant is 404; the history pages newest first."""
from __future__ import annotations

import uuid

import pytest

from aivedio.policy import tenant_policy as policy
from aivedio.admin.operators import create_operator
from tests.admission_support import new_tenant, serve  # noqa: F401 - serve is a fixture

pytestmark = pytest.mark.timeout(120)
ROLES = ("viewer", "operator", "finance", "admin")
WRITERS = {"operator", "admin"}


@pytest.fixture
def api(platform, serve):  # noqa: F811 - the fixture imported above
    a = serve(platform)
    tokens = {}
    for role in ROLES:
        issued = platform.db.transaction(lambda c, role=role: create_operator(
            c, actor="test", name=f"{role}-{uuid.uuid4().hex[:6]}", role=role))
        tokens[role] = (issued.name, issued.token)
    return a.http, tokens


def _h(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _path(tenant_id) -> str:
    return f"/admin/v1/tenants/{tenant_id}/policy"


@pytest.mark.parametrize("role", ROLES)
def test_each_role_reads_and_only_operator_and_admin_change(platform, conn, api, role):
    http, tokens = api
    name, token = tokens[role]
    t = new_tenant(platform, weight=10)
    r = http.get(_path(t.tenant_id), headers=_h(token))
    assert r.status_code == 200, r.text
    assert r.json()["policy_version"] == 1 and r.json()["weight"] == 10 and set(policy.NAMES) <= set(r.json())

    r = http.patch(_path(t.tenant_id), headers=_h(token), json={"changes": {"weight": 4}, "reason": f"by {role}"})
    if role in WRITERS:
        assert r.status_code == 200, r.text
        assert (r.json()["policy_version"], r.json()["weight"]) == (2, 4)
        a = conn.execute("select * from audit_log where action = 'policy.set' and tenant_id = %s", (t.tenant_id,)).fetchone()
        assert (a["operator"], a["reason"], a["policy_version"], a["old_value"], a["new_value"]) == (
            f"op:{name}", f"by {role}", 2, {"weight": 10}, {"weight": 4})
    else:
        assert r.status_code == 403 and r.json()["error"] == "FORBIDDEN", r.text
        assert http.get(_path(t.tenant_id), headers=_h(token)).json()["policy_version"] == 1
        denied = conn.execute("select * from audit_log where operator = %s and action = 'policy.write.denied'",
                              (f"op:{name}",)).fetchall()
        assert len(denied) == 1

    r = http.get(_path(t.tenant_id) + "/history", headers=_h(token))
    assert r.status_code == 200, r.text
    assert [i["policy_version"] for i in r.json()["items"]] == ([2, 1] if role in WRITERS else [1])


def test_an_invalid_patch_is_422_naming_each_field_and_changes_nothing(platform, api):
    http, tokens = api
    token = tokens["operator"][1]
    t = new_tenant(platform, service_class="PAID_SHARED")  # max_queued_tasks 10_000, max_running_units 240
    before = http.get(_path(t.tenant_id), headers=_h(token)).json()
    for changes, fields in [
        ({"weight": -3}, {"weight"}),
        ({"max_running_tasks": 20_000}, {"max_running_tasks"}),
        ({"reserved_units": 1500, "max_running_units": 2000}, {"reserved_units"}),
        ({"no_such_column": 1, "weight": "heavy"}, {"no_such_column", "weight"}),
        ({}, {"changes"}),
    ]:
        r = http.patch(_path(t.tenant_id), headers=_h(token), json={"changes": changes, "reason": "bad"})
        assert r.status_code == 422, (changes, r.text)
        body = r.json()
        assert body["error"] == "VALIDATION_ERROR" and set(body["details"]["fields"]) == fields, body
        assert {e["field"] for e in body["details"]["errors"]} == fields
    r = http.patch(_path(t.tenant_id), headers=_h(token), json={"reason": "no changes"})
    assert r.status_code == 422  # the envelope itself (pydantic): changes is required
    assert http.get(_path(t.tenant_id), headers=_h(token)).json() == before


def test_an_unknown_tenant_is_404(api):
    http, tokens = api
    token = tokens["admin"][1]
    for tid in (uuid.uuid4(), "not-a-uuid"):
        assert http.get(_path(tid), headers=_h(token)).status_code == 404
        assert http.patch(_path(tid), headers=_h(token), json={"changes": {"weight": 2}}).status_code == 404
        assert http.get(_path(tid) + "/history", headers=_h(token)).status_code == 404


def test_the_history_pages_newest_first(platform, api):
    http, tokens = api
    token = tokens["operator"][1]
    t = new_tenant(platform, weight=10)
    for w in (2, 3, 4):
        assert http.patch(_path(t.tenant_id), headers=_h(token), json={"changes": {"weight": w}}).status_code == 200
    seen, cursor = [], None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = http.get(_path(t.tenant_id) + "/history", headers=_h(token), params=params).json()
        seen += [(i["policy_version"], i["policy"]["weight"]) for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [(4, 4), (3, 3), (2, 2), (1, 10)]
    assert http.get(_path(t.tenant_id) + "/history", headers=_h(token), params={"cursor": "%%%"}).status_code == 422


def test_a_tenant_key_is_refused_on_the_policy_routes(platform, api):
    http, _ = api
    t = new_tenant(platform)
    r = http.get(_path(t.tenant_id), headers=_h(t.api_key))
    assert r.status_code == 403 and r.json()["error"] == "FORBIDDEN"


def test_reserved_units_are_held_against_the_lane_capacity_in_force(platform, api):
    from aivedio.admin import capacity

    http, tokens = api
    token = tokens["operator"][1]
    t = new_tenant(platform, service_class="PAID_SHARED")
    platform.db.transaction(lambda c: capacity.set_lane(c, platform.config, operator="test", lane="PAID_SHARED",
                                                        reason="smaller lane", capacity_units=1000))
    change = {"reserved_units": 1100, "max_running_units": 2000}  # within the file's 1200 units, not the 1000 in force
    r = http.patch(_path(t.tenant_id), headers=_h(token), json={"changes": change})
    assert r.status_code == 422 and set(r.json()["details"]["fields"]) == {"reserved_units"}, r.text
    r = http.patch(_path(t.tenant_id), headers=_h(token), json={"changes": {**change, "reserved_units": 900}})
    assert r.status_code == 200 and r.json()["reserved_units"] == 900, r.text
