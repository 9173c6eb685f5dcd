"""`aivedio admin lane|pool|provider-account|switch|price ...`: capacities, borrowing limits,
provider account concurrency, admission switches and price versions, changed at run time through
aivedio.admin.capacity and aivedio.admin.prices. A write is audited with the old and new values and
the --reason given, and is in force in every process within seconds.

    aivedio admin lane list
    aivedio admin lane set --lane L [--capacity-units N] [--borrowable-units N] [--min-headroom-units N]
                           [--max-queue-units N] [--reason R]
    aivedio admin pool list | set --key worker:gpu --capacity-units N [--reason R]
    aivedio admin provider-account list | set --provider P --account-id A --max-concurrency N [--reason R]
    aivedio admin switch list | set (--lane L | --resource-class RC) (--open | --closed) [--reason R]
    aivedio admin price list [--product-code P] [--limit N] [--cursor C]
    aivedio admin price create [--effective-from T] [--effective-to T] (--rules JSON | --rules-file F) [--reason R]

Bad input prints {"error": "VALIDATION_ERROR", "details": {"fields": {...}}} and exits 1, having
written nothing."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

from aivedio.admin import capacity, prices
from aivedio.errors import InvalidRequest
from aivedio.policy.capacity import overrides
from aivedio.pricing.price_book import PRODUCT_CODE, list_price_versions
from aivedio_tools.cli.common import add_common, number, operator, run, table, when


def _change(args: argparse.Namespace, fn: Callable[[Any, Any], dict]) -> int:
    """A write: fn(platform, conn) in one transaction, then this process's cached overrides dropped."""
    return run(args, lambda p, _: capacity.run_change(p, lambda conn: fn(p, conn)), transaction=False)


def _by(rows: list[dict]) -> list[dict]:
    return [{**r, "changed_by": (r.get("override") or {}).get("updated_by")} for r in rows]


def _rows(columns: list[str]):
    return lambda doc: table(_by(doc["items"]), columns)


# --- lanes ----------------------------------------------------------------------------------------

def _lane_list(args) -> int:
    return run(args, lambda p, _: {"items": capacity.lane_report(p)}, transaction=False, human=_rows([
        "lane", "capacity_units", "borrowable_units", "in_force_units", "queued_units", "running_units",
        "oldest_wait_seconds", "admission_open", "changed_by"]))


def _lane_set(args) -> int:
    return _change(args, lambda p, c: capacity.set_lane(
        c, p.config, operator=operator(args), lane=args.lane, reason=args.reason, capacity_units=args.capacity_units,
        borrowable_units=args.borrowable_units, min_headroom_units=args.min_headroom_units,
        max_queue_units=args.max_queue_units, now=p.clock.now()))


# --- pools ----------------------------------------------------------------------------------------

def _pool_list(args) -> int:
    return run(args, lambda p, c: {"items": capacity.pool_report(c, p.config, overrides(p, c))}, human=_rows([
        "key", "configured_units", "capacity_units", "in_force_units", "used_units", "changed_by"]))


def _pool_set(args) -> int:
    return _change(args, lambda p, c: capacity.set_pool(c, p.config, operator=operator(args), key=args.key,
                                                        capacity_units=args.capacity_units, reason=args.reason,
                                                        now=p.clock.now()))


# --- provider accounts --------------------------------------------------------------------------------

def _account_list(args) -> int:
    return run(args, lambda p, c: {"items": capacity.provider_account_report(c, p.config, overrides(p, c))},
               human=_rows(["provider", "account_id", "region", "configured_max_concurrency", "max_concurrency",
                            "in_force_units", "used_units", "changed_by"]))


def _account_set(args) -> int:
    return _change(args, lambda p, c: capacity.set_provider_account(
        c, p.config, operator=operator(args), provider=args.provider, account_id=args.account_id,
        max_concurrency=args.max_concurrency, reason=args.reason, now=p.clock.now()))


# --- switches -------------------------------------------------------------------------------------

def _switch_list(args) -> int:
    return run(args, lambda p, _: {"items": capacity.switch_report(p.config, overrides(p))}, transaction=False,
               human=_rows(["switch", "open", "changed_by"]))


def _switch_set(args) -> int:
    return _change(args, lambda p, c: capacity.set_switch(c, p.config, operator=operator(args), open=args.open,
                                                          reason=args.reason, lane=args.lane,
                                                          resource_class=args.resource_class, now=p.clock.now()))


# --- prices ---------------------------------------------------------------------------------------

def _price_list(args) -> int:
    return run(args, lambda p, c: list_price_versions(c, product_code=args.product_code, limit=args.limit,
                                                      cursor=args.cursor),
               human=lambda d: table(d["items"], ["price_version_id", "product_code", "effective_from", "effective_to",
                                                  "status", "created_by"]))


def _price_create(args) -> int:
    def fn(p, c):
        text = Path(args.rules_file).read_text() if args.rules_file else args.rules
        try:
            rules = json.loads(text)
        except (json.JSONDecodeError, TypeError):
            raise InvalidRequest("rules are not JSON", {"rules": 'a JSON object, e.g. {"models": {"video-model-x": '
                                                                 '{"per_second_amount": 12}}}'}) from None
        models = rules.get("models", {}) if isinstance(rules, dict) else rules
        return prices.create_price_version(c, p.config, operator=operator(args), effective_from=args.effective_from,
                                           effective_to=args.effective_to, models=models, reason=args.reason,
                                           now=p.clock.now(), product_code=args.product_code or PRODUCT_CODE)

    return _change(args, fn)


# --- registration ---------------------------------------------------------------------------------

def register(admin) -> None:
    def write(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--reason", default=None, help="why: kept in the audit log with the old and new values")
        return add_common(p)

    lane = admin.add_parser("lane", help="lane capacities, borrowing limits and queue limits").add_subparsers(
        dest="lane_command", required=True)
    add_common(lane.add_parser("list", help="each lane's capacity in force, queue, running units and oldest wait")
            ).set_defaults(fn=_lane_list)
    s = write(lane.add_parser("set", help="override a lane's capacity figures (the pool is resized at once; "
                                          "lowering never cuts running work)"))
    s.add_argument("--lane", required=True)
    for flag, meaning in (("--capacity-units", "fairness units of the lane's tasks that may run at once"),
                          ("--borrowable-units", "units other lanes may borrow while this one has nothing queued"),
                          ("--min-headroom-units", "free units kept back from lending"),
                          ("--max-queue-units", "queued units above which admission answers REJECT_LANE_QUEUE_FULL")):
        s.add_argument(flag, type=number, default=None, metavar="N", help=f"{meaning} (unset: unchanged)")
    s.set_defaults(fn=_lane_set)

    pool = admin.add_parser("pool", help="resource pools: worker:cpu, worker:gpu, cost:platform, model:<model>"
                            ).add_subparsers(dest="pool_command", required=True)
    add_common(pool.add_parser("list", help="each pool's configured and effective capacity and use")).set_defaults(fn=_pool_list)
    s = write(pool.add_parser("set", help="override a pool's capacity"))
    s.add_argument("--key", required=True, help="the pool's resource key, e.g. worker:gpu")
    s.add_argument("--capacity-units", type=number, required=True, metavar="N", help="the pool's units, in force at once")
    s.set_defaults(fn=_pool_set)

    acct = admin.add_parser("provider-account", help="provider accounts' concurrency").add_subparsers(
        dest="provider_account_command", required=True)
    add_common(acct.add_parser("list", help="each account's max_concurrency, what claims obey now and slots in use")
            ).set_defaults(fn=_account_list)
    s = write(acct.add_parser("set", help="override an account's max_concurrency (running jobs finish; new claims "
                                          "wait until fewer than the new limit run)"))
    s.add_argument("--provider", required=True)
    s.add_argument("--account-id", required=True, help="the account's id, as in the provider's config entry")
    s.add_argument("--max-concurrency", type=number, required=True, metavar="N",
                   help="jobs the account may have at the provider at once")
    s.set_defaults(fn=_account_set)

    switch = admin.add_parser("switch", help="admission switches of lanes and resource classes").add_subparsers(
        dest="switch_command", required=True)
    add_common(switch.add_parser("list", help="every switch, open or closed")).set_defaults(fn=_switch_list)
    s = write(switch.add_parser("set", help="open or close admission; closed answers REJECT_RESOURCE_CLASS_DISABLED"))
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--lane", help="the lane whose admission to switch")
    which.add_argument("--resource-class", help="the resource class to switch (video-standard, video-4k, video-v2v)")
    state = s.add_mutually_exclusive_group(required=True)
    state.add_argument("--open", dest="open", action="store_true", default=None, help="admit again")
    state.add_argument("--closed", dest="open", action="store_false", help="refuse new tasks (running work goes on)")
    s.set_defaults(fn=_switch_set)

    price = admin.add_parser("price", help="price book versions (immutable, never overlapping)").add_subparsers(
        dest="price_command", required=True)
    ls = add_common(price.add_parser("list", help="price versions, newest first"))
    ls.add_argument("--product-code", default=None)
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--cursor", default=None, help="the next_cursor of the page before")
    ls.set_defaults(fn=_price_list)
    c = write(price.add_parser("create", help="a new version from --effective-from (default now); the open version "
                                              "in force then is closed there, any other overlap is refused"))
    c.add_argument("--product-code", default=None)
    c.add_argument("--effective-from", type=when, default=None, metavar="ISO-TIME", help="when it takes effect (default now)")
    c.add_argument("--effective-to", type=when, default=None, metavar="ISO-TIME", help="when it ends (default: open-ended)")
    rules = c.add_mutually_exclusive_group(required=True)
    rules.add_argument("--rules", help='JSON: {"models": {MODEL: {FIELD: VALUE}}}; fields left out keep the '
                                       "version it follows")
    rules.add_argument("--rules-file", help="a file holding the --rules JSON")
    c.set_defaults(fn=_price_create)
