"""What every command of the `aivedio` CLI shares: the platform it runs against, who acts, the
common flags, how a result or a refusal is printed.

The CLI runs with the database's credentials and is trusted as such, like psql: it never refuses a
documented command for want of a role. `--operator NAME` (default `cli:<os user>`) names who acts
in the audit log; the money controls that are not about roles still hold (another operator's
approval above a threshold, an operator's daily refund limit).

Output: with `--json`, exactly one JSON document on stdout; without, a table or lines for a person.
A domain error prints `{"error": CODE, "message", "details"}` (with --json) or `aivedio: CODE:
message` and the bad fields on stderr, and exits 1, having written nothing. A bad setting (the
config file, a flag out of range) exits 2. Logs go to stderr."""
from __future__ import annotations

import argparse
import getpass
import json
import sys
from collections.abc import Callable, Iterable
from datetime import date, datetime
from typing import Any

from aivedio import audit
from aivedio.billing.errors import AUDITED_REFUSALS
from aivedio.config import Settings, load_config, settings_from_env
from aivedio.context import Platform, build_platform
from aivedio.errors import DomainError
from aivedio_tools.local.embedded import with_embedded_servers

Human = Callable[[Any], "str | Iterable[str]"]


# --- flags --------------------------------------------------------------------------------------------

def add_common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--operator, --config and --json, as every command that reads or writes the platform takes them."""
    p.add_argument("--operator", default=None, help="who acts, for the audit log (default cli:<os user>)")
    p.add_argument("--config", default=None, help="the platform's config file (default: AIVEDIO_CONFIG)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    return p


# What a flag means wherever a command takes it without saying more: build_parser fills these in, so
# `--help` and docs/cli.md explain each common flag once and alike.
FLAG_MEANINGS = {
    "tenant_id": "the tenant's id",
    "task_id": "the task's id",
    "wallet_id": "the wallet's id",
    "refund_id": "the refund's id",
    "operator_id": "the operator's id",
    "txn_id": "the ledger transaction's id",
    "case_id": "the support case it belongs to, for the audit log",
    "reason": "why, for the audit log",
    "limit": "at most this many rows",
    "provider": "the provider's name, as in the config file",
    "lane": "the lane's name (ENTERPRISE_RESERVED, PAID_SHARED, STANDARD, BEST_EFFORT)",
    "product_code": "the product's code in the price book",
    "period_start": "when the period starts (ISO 8601, with its timezone)",
    "json": "one JSON document on stdout",
    "host": "the address to listen on",
    "port": "the port to listen on",
    "seed": "the seed every random draw derives from",
}


def describe_flags(parser: argparse.ArgumentParser) -> None:
    """Give every flag of FLAG_MEANINGS that has no help its meaning, in this parser and all below it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                describe_flags(child)
        elif action.help is None and action.dest in FLAG_MEANINGS:
            action.help = FLAG_MEANINGS[action.dest]


def operator(args: argparse.Namespace) -> str:
    return getattr(args, "operator", None) or f"cli:{getpass.getuser()}"


def when(text: str) -> datetime:
    """An ISO 8601 time with its timezone (argparse type)."""
    try:
        d = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an ISO 8601 time, e.g. 2026-06-01T00:00:00Z") from None
    if d.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give a timezone (e.g. 2026-06-01T00:00:00Z)")
    return d


def day(text: str) -> date:
    """YYYY-MM-DD (argparse type)."""
    try:
        if len(text) != 10:
            raise ValueError
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected YYYY-MM-DD") from None


def month(text: str) -> date:
    """YYYY-MM, as the month's first day (argparse type)."""
    try:
        return datetime.strptime(text, "%Y-%m").date()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected YYYY-MM") from None


def number(text: str) -> int | str:
    """An integer flag, or the text as typed: the core names the field it rejects (exit 1, JSON)."""
    try:
        return int(text)
    except ValueError:
        return text


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


# --- the platform -------------------------------------------------------------------------------------

def settings(args: argparse.Namespace) -> Settings:
    """The environment's settings, with --config when given."""
    s = settings_from_env()
    if getattr(args, "config", None):
        s = s.model_copy(update={"config_file": args.config})
    return s


def platform_for(args: argparse.Namespace, *, migrate: bool = True, **kw) -> Platform:
    """The platform the environment names (an embedded server for what it leaves unset)."""
    s = settings(args)
    return build_platform(with_embedded_servers(s), load_config(s.config_file), migrate=migrate, **kw)


# --- output -------------------------------------------------------------------------------------------

def _plain(v: Any) -> str:
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, default=str, sort_keys=True)
    return str(v)


def emit(doc: Any, as_json: bool) -> None:
    """One JSON document, or a line per key (nested values as compact JSON, never a Python repr)."""
    if as_json:
        sys.stdout.write(json.dumps(doc, default=str, sort_keys=True) + "\n")
        return
    for k, v in (doc.items() if isinstance(doc, dict) else enumerate(doc)):
        sys.stdout.write(f"{k}: {_plain(v)}\n")


def table(rows: list[dict], columns: list[str]) -> list[str]:
    """Rows as aligned columns under a header; None shows as '-'."""
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    return ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()] + \
        ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]


def show(doc: Any, args: argparse.Namespace, human: Human | None = None) -> None:
    """The result: JSON with --json, else `human(doc)` (lines or one text), else a line per key."""
    if args.json or human is None:
        emit(doc, args.json)
        return
    out = human(doc)
    sys.stdout.write(out if isinstance(out, str) else "".join(f"{line}\n" for line in out))


def refusal(e: DomainError, args: argparse.Namespace) -> int:
    """Print a domain error as the document or the lines the module docstring describes; exit 1."""
    if args.json:
        emit({"error": e.code, "message": e.message, "details": e.details}, True)
    else:
        sys.stderr.write(f"aivedio: {e.code}: {e.message}\n")
        for field, why in (e.details.get("fields") or {}).items():
            sys.stderr.write(f"  {field}: {why}\n")
    return 1


# --- running a command --------------------------------------------------------------------------------

def run(args: argparse.Namespace, fn: Callable[[Platform, Any], Any], *, transaction: bool = True,
        human: Human | None = None, audit_refusal: str | None = None) -> int:
    """Build the platform, run fn(platform, conn) in one transaction (transaction=False: fn(platform,
    None), which opens its own), print the result. A money operation named by `audit_refusal` that a
    money control refuses leaves an audit row of its own."""
    platform = platform_for(args)
    try:
        doc = platform.db.transaction(lambda conn: fn(platform, conn)) if transaction else fn(platform, None)
    except DomainError as e:
        if audit_refusal is not None and e.code in AUDITED_REFUSALS:
            _audit_refused(platform, args, audit_refusal, e)
        return refusal(e, args)
    finally:
        platform.close()
    show(doc, args, human)
    return 0


def _audit_refused(platform: Platform, args: argparse.Namespace, action: str, e: DomainError) -> None:
    target = next((f"{k.removesuffix('_id')}:{getattr(args, k)}" for k in ("task_id", "refund_id")
                   if getattr(args, k, None) is not None), "refund")
    platform.db.transaction(lambda c: audit.append(
        c, operator=operator(args), action=f"{action}.refused", target=target, tenant_id=getattr(args, "tenant_id", None),
        new={"error": e.code, "amount": getattr(args, "amount", None), "details": e.details}, reason=e.message))

