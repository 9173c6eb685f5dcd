"""`aivedio admin outbox list|redrive` and `aivedio admin queue redrive` (aivedio.admin.dead_letters).
Each runs in one transaction: the permission check, the change and its audit rows (the queue
redrive, whose change is in AWS, audits it before and after, each row committed); a refusal prints
{"error": CODE, ...} and exits 1, having written nothing (SQS failing to start a move is
QUEUE_MOVE_FAILED, and audited). With --json, one JSON document on
stdout; without, a table or lines."""
from __future__ import annotations

import argparse
import sys
from functools import cache
from uuid import UUID

from aivedio import outbox


@cache
def _sqs():
    import boto3

    return boto3.client("sqs")


def _run(args: argparse.Namespace, fn, render, *, transaction: bool = True) -> int:
    """aivedio_tools.cli.admin_billing._run, with a human rendering of its own: fn(platform, conn) in one
    transaction (without one, fn(platform, None), which opens its own); a domain error prints
    {"error": ...} (with --json) or a line on stderr, exit 1."""
    from aivedio_tools.cli import _emit, _platform
    from aivedio.errors import DomainError

    platform = _platform(args)
    try:
        doc = platform.db.transaction(lambda conn: fn(platform, conn)) if transaction else fn(platform, None)
    except DomainError as e:
        if args.json:
            _emit({"error": e.code, "message": e.message, "details": e.details}, True)
        else:
            sys.stderr.write(f"aivedio: {e.code}: {e.message}\n")
        return 1
    finally:
        platform.close()
    if args.json:
        _emit(doc, True)
    else:
        render(doc)
    return 0


def _show_list(doc: dict) -> None:
    out = sys.stdout
    out.write(f"{doc['count']} {doc['status']} event(s) shown, {doc['dead_letters']} FAILED in all\n")
    if doc["events"]:
        out.write(f"{'EVENT_ID':<36}  {'EVENT_TYPE':<24} {'ATTEMPTS':>8}  {'CREATED_AT':<32}  LAST_ERROR\n")
    for e in doc["events"]:
        err = (e["last_error"] or "").replace("\n", " ")[:80]
        out.write(f"{e['event_id']:<36}  {e['event_type']:<24} {e['attempts']:>8}  {e['created_at']:<32}  {err}\n")


def _show_redrive(doc: dict) -> None:
    sys.stdout.write(f"{doc['redriven']} event(s) back to PENDING\n")
    for e in doc["events"]:
        sys.stdout.write(f"  {e['event_id']}  {e['event_type']}  (had {e['attempts_before']} attempts)\n")
    for i in doc["not_failed"]:
        sys.stdout.write(f"  {i}  not a FAILED event: left as it is\n")


def _show_queue(doc: dict) -> None:
    sys.stdout.write(f"moving about {doc['messages']} message(s) from {doc['dlq']} back to {doc['source']} "
                     f"(task {doc['task_handle']})\n")


def _outbox_list(args: argparse.Namespace) -> int:
    from aivedio.admin import dead_letters
    from aivedio_tools.cli.admin_billing import _operator

    return _run(args, lambda p, c: dead_letters.list_outbox(c, operator=_operator(args), status=args.status,
                                                            event_type=args.event_type, tenant_id=args.tenant_id,
                                                            limit=args.limit), _show_list)


def _outbox_redrive(args: argparse.Namespace) -> int:
    from aivedio.admin import dead_letters
    from aivedio_tools.cli.admin_billing import _operator

    return _run(args, lambda p, c: dead_letters.redrive_outbox(c, operator=_operator(args), reason=args.reason,
                                                               event_ids=args.event_id, all_failed=args.all_failed,
                                                               event_type=args.event_type), _show_redrive)


def _queue_redrive(args: argparse.Namespace) -> int:
    from aivedio.admin import dead_letters
    from aivedio_tools.cli.admin_billing import _operator

    # Its own transactions: the audit row commits before the move starts (dead_letters.redrive_queue).
    return _run(args, lambda p, _: dead_letters.redrive_queue(p, _sqs(), operator=_operator(args), queue=args.queue,
                                                              reason=args.reason, max_per_second=args.max_per_second),
                _show_queue, transaction=False)


def register(admin) -> None:
    """Add `outbox` and `queue` to `aivedio admin`'s sub-parsers."""
    from aivedio_tools.cli.admin_billing import _common

    ob = admin.add_parser("outbox", help="outbox dead letters (events that failed every delivery)").add_subparsers(
        dest="outbox_command", required=True)
    ls = _common(ob.add_parser("list", help="events of one status, oldest first (needs outbox.read)"))
    ls.add_argument("--status", default=outbox.FAILED, choices=[outbox.FAILED, outbox.PENDING, outbox.PUBLISHED])
    ls.add_argument("--event-type", default=None)
    ls.add_argument("--tenant-id", type=UUID, default=None)
    ls.add_argument("--limit", type=int, default=100)
    ls.set_defaults(fn=_outbox_list)
    rd = _common(ob.add_parser("redrive", help="FAILED events back to PENDING, attempts reset, due now (needs outbox.redrive; "
                                               "audited)"))
    which = rd.add_mutually_exclusive_group(required=True)
    which.add_argument("--event-id", type=UUID, action="append", default=None, help="repeat for several")
    which.add_argument("--all-failed", action="store_true", help="every FAILED event (of --event-type)")
    rd.add_argument("--event-type", default=None, help="with --all-failed: only this type")
    rd.add_argument("--reason", required=True)
    rd.set_defaults(fn=_outbox_redrive)

    q = admin.add_parser("queue", help="SQS dead-letter queues (AWS)").add_subparsers(dest="queue_command", required=True)
    qr = _common(q.add_parser("redrive", help="move a DLQ's messages back to their queue with SQS StartMessageMoveTask "
                                              "(needs queue.redrive; audited)"))
    qr.add_argument("--queue", required=True, help="the queue's name or URL (or its DLQ's), e.g. aivedio-prod-settlement")
    qr.add_argument("--max-per-second", type=int, default=None, help="SQS's move rate (default: SQS's own, up to 500)")
    qr.add_argument("--reason", default=None)
    qr.set_defaults(fn=_queue_redrive)
