"""Pure parts of the operator plane (issue 16): the role table of aivedio.policy.roles, the audit
list's opaque cursor, and the admin token's shape. No database."""
from __future__ import annotations

import hashlib

import pytest

from aivedio.admin.operators import ADMIN_TOKEN_PREFIX, _new_token, hash_token, validate_name, validate_role
from aivedio.audit import _decode_cursor, _encode_cursor
from aivedio.auth import KEY_PREFIX
from aivedio.errors import InvalidRequest
from aivedio.policy import roles


def test_each_role_has_exactly_its_permission_sets():
    p = roles.ROLE_PERMISSIONS
    assert p["viewer"] == roles.READ_PERMISSIONS
    assert p["operator"] == roles.READ_PERMISSIONS | roles.OPERATOR_PERMISSIONS
    assert p["finance"] == roles.READ_PERMISSIONS | roles.FINANCE_PERMISSIONS
    every = frozenset().union(*(perms for role, perms in p.items() if role != "admin"))
    assert p["admin"] == every | roles.ADMIN_ONLY_PERMISSIONS == roles.ALL_PERMISSIONS
    assert {"operator.manage", "tenant.manage", "audit.verify"} <= p["admin"]
    for role in ("viewer", "operator", "finance"):
        assert not p[role] & roles.ADMIN_ONLY_PERMISSIONS
    assert not p["operator"] & roles.FINANCE_PERMISSIONS and not p["finance"] & roles.OPERATOR_PERMISSIONS


@pytest.mark.parametrize("role, permission, ok", [
    ("viewer", "audit.read", True), ("viewer", "switch.read", True), ("viewer", "policy.write", False),
    ("operator", "policy.write", True), ("operator", "outbox.redrive", True), ("operator", "refund.approve", False),
    ("finance", "refund.approve", True), ("finance", "price.write", True), ("finance", "capacity.write", False),
    ("admin", "operator.manage", True), ("admin", "wallet.unfreeze", True), ("finance", "operator.manage", False),
    ("operator", "audit.verify", False), ("nobody", "audit.read", False), ("admin", "no.such.permission", False),
    ("BILLING_ADMIN", "refund.approve", False)])  # the CLI's old role names are no roles
def test_allowed(role, permission, ok):
    assert roles.allowed(role, permission) is ok


def test_there_is_one_role_model():
    assert roles.ROLES == ("viewer", "operator", "finance", "admin") == tuple(roles.ROLE_PERMISSIONS)


def test_the_cursor_is_opaque_and_round_trips():
    for audit_id in (1, 42, 2**62):
        c = _encode_cursor(audit_id)
        assert str(audit_id) not in c and _decode_cursor(c) == audit_id
    for bad in ("", "x", "eyJhdWRpdF9pZCI6ICJ4In0", "e30", "W10", "dHJ1ZQ"):
        with pytest.raises(InvalidRequest):
            _decode_cursor(bad)


def test_admin_tokens_never_look_like_tenant_keys():
    t = _new_token()
    assert t.startswith(ADMIN_TOKEN_PREFIX) and not t.startswith(KEY_PREFIX) and len(t) >= 45
    assert hash_token(t) == hashlib.sha256(t.encode()).hexdigest() and _new_token() != t


def test_names_and_roles_are_validated():
    assert validate_name("  ops-jane ") == "ops-jane" and validate_role("finance") == "finance"
    for bad in ("", " ", "x" * 65, "a\nb", 3):
        with pytest.raises(InvalidRequest) as e:
            validate_name(bad)
        assert set(e.value.fields) == {"name"}
    with pytest.raises(InvalidRequest) as e:
        validate_role("FINANCE_APPROVER")
    assert set(e.value.fields) == {"role"}
