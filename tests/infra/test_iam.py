"""Least privilege: no role may do everything, and each function's role allows exactly what its
profile and the routing table say it uses, on exactly those resources."""
from __future__ import annotations

import pytest

pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
pytest.importorskip("cdk_nag", reason="the cdk extra is not installed: pip install -e '.[cdk]'")

import json

from aivedio import events_routing
from infra_cdk.functions import PROFILES
from tests.infra.helpers import (capabilities, expected_capabilities, lambdas, queue_name, role_logical_id,
                                 statements_of_role)


def _all_statements(template: dict):
    for lid, r in template["Resources"].items():
        if r["Type"] == "AWS::IAM::Role":
            for p in r["Properties"].get("Policies", []):
                for st in p["PolicyDocument"]["Statement"]:
                    yield lid, st
        elif r["Type"] in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy"):
            for st in r["Properties"]["PolicyDocument"]["Statement"]:
                yield lid, st


def _list(v):
    return v if isinstance(v, list) else [v]


def test_no_role_carries_star_star(synth, stage):
    for kind in ("Data", "App"):
        for lid, st in _all_statements(synth.template_json(stage, kind)):
            actions = _list(st.get("Action", []))
            assert not any(a in ("*", "*:*") for a in actions), f"{stage}-{kind} {lid}: Action '*' in {st}"
            if "*" in _list(st.get("Resource", [])):
                assert not any(a.endswith(":*") for a in actions), f"{stage}-{kind} {lid}: service:* on '*' in {st}"


def test_no_role_uses_admin_or_full_access_managed_policies(synth, stage):
    for kind in ("Data", "App"):
        for lid, r in synth.resources(stage, kind, "AWS::IAM::Role").items():
            text = json.dumps(r["Properties"].get("ManagedPolicyArns", []))
            assert "AdministratorAccess" not in text and "FullAccess" not in text, f"{lid}: {text}"


def test_each_function_has_its_own_role_without_managed_policies(synth, stage):
    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    roles = [role_logical_id(fn) for fn in fns.values()]
    assert len(set(roles)) == len(roles), "two functions share a role"
    for role in roles:
        assert not template["Resources"][role]["Properties"].get("ManagedPolicyArns")


def test_each_function_can_reach_only_what_it_uses(synth, stage):
    template = synth.template_json(stage, "App")
    for name, fn in lambdas(template).items():
        got = capabilities(template, fn)
        want = expected_capabilities(stage, name, PROFILES[name])
        assert got == want, f"{name}: extra {sorted(got - want)}, missing {sorted(want - got)}"


def test_the_api_cannot_touch_any_queue(synth, stage):
    template = synth.template_json(stage, "App")
    fn = lambdas(template)["api"]
    actions = [a for st in statements_of_role(template, role_logical_id(fn)) for a in _list(st["Action"])]
    assert not [a for a in actions if a.startswith(("sqs:", "sns:", "events:", "states:"))]


def test_consumers_consume_only_their_own_queue_and_send_nowhere(synth, stage):
    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    for consumer in events_routing.queue_consumers():  # outbox events' consumers and AWS events' (Batch)
        caps = capabilities(template, fns[consumer])
        assert {c for c in caps if c.startswith(("consume:", "send:"))} == {f"consume:{queue_name(stage, consumer)}"}
    for name, fn in fns.items():
        if name not in events_routing.queue_consumers():
            assert not [c for c in capabilities(template, fn) if c.startswith("consume:")], name


def test_only_the_outbox_relay_publishes(synth, stage):
    template = synth.template_json(stage, "App")
    senders = {n for n, fn in lambdas(template).items() if any(c.startswith("send:") for c in capabilities(template, fn))}
    assert senders == {n for n, p in PROFILES.items() if p.publishes_events} == {"outbox_relay"}


def test_network_paths_to_the_database_and_redis_follow_the_profiles(synth, stage):
    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    sg_owner = {fn["Properties"]["VpcConfig"]["SecurityGroupIds"][0]["Fn::GetAtt"][0]: n for n, fn in fns.items()}
    reach: dict[str, set[str]] = {"ProxySg": set(), "RedisSg": set()}
    for r in synth.resources(stage, "App", "AWS::EC2::SecurityGroupIngress").values():
        target = json.dumps(r["Properties"]["GroupId"])
        source = r["Properties"].get("SourceSecurityGroupId", {}).get("Fn::GetAtt", [None])[0]
        for key in reach:
            if key in target and source in sg_owner:
                reach[key].add(sg_owner[source])
    assert reach["ProxySg"] == {n for n, p in PROFILES.items() if p.database}
    assert reach["RedisSg"] == {n for n, p in PROFILES.items() if p.redis}


def test_only_the_maintenance_function_reaches_the_invoice_archive(synth, stage):
    """The invoice reconciler (a maintenance service) archives raw invoices: Put and Get on the
    archive's objects, nothing else there, and its bucket from the stack (AIVEDIO_INVOICE_BUCKET)."""
    template = synth.template_json(stage, "App")
    assert {n for n, p in PROFILES.items() if p.archives_invoices} == {"maintenance"}
    for name, fn in lambdas(template).items():
        env = fn["Properties"]["Environment"]["Variables"]
        caps = capabilities(template, fn)
        if name == "maintenance":
            assert {"invoices-read", "invoices-write"} <= caps
            assert "BucketsInvoiceArchive" in json.dumps(env["AIVEDIO_INVOICE_BUCKET"])
        else:
            assert not {c for c in caps if c.startswith("invoices-")} and "AIVEDIO_INVOICE_BUCKET" not in env, name
