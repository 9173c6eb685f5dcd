"""`aivedio admin outbox list|redrive` and `aivedio admin queue redrive` (aivedio.admin.dead_letters).
Each runs in one transaction, the change with its audit rows; the queue redrive, whose change is in
AWS, audits it before and after, each row committed (SQS failing to start a move is
QUEUE_MOVE_FAILED, and audited)."""
from __future__ import annotations

import argparse
from functools import cache
from uuid import UUID

from aivedio import outbox
from aivedio.admin import dead_letters
from aivedio_tools.cli.common import add_common, operator, run


@cache
def _sqs():
    import boto3  # lazy: importing boto3 takes most of a second, and only this AWS command needs it

    return boto3.client("sqs")


def _show_list(doc: dict) -> list[str]:
    lines = [f"{doc['count']} {doc['status']} event(s) shown, {doc['dead_letters']} FAILED in all"]
    if doc["events"]:
        lines.append(f"{'EVENT_ID':<36}  {'EVENT_TYPE':<24} {'ATTEMPTS':>8}  {'CREATED_AT':<32}  LAST_ERROR")
    for e in doc["events"]:
        err = (e["last_error"] or "").replace("\n", " ")[:80]
        lines.append(f"{e['event_id']:<36}  {e['event_type']:<24} {e['attempts']:>8}  {e['created_at']:<32}  {err}")
    return lines


def _show_redrive(doc: dict) -> list[str]:
    return ([f"{doc['redriven']} event(s) back to PENDING"]
            + [f"  {e['event_id']}  {e['event_type']}  (had {e['attempts_before']} attempts)" for e in doc["events"]]
            + [f"  {i}  not a FAILED event: left as it is" for i in doc["not_failed"]])


def _show_queue(doc: dict) -> list[str]:
    return [f"moving about {doc['messages']} message(s) from {doc['dlq']} back to {doc['source']} "
            f"(task {doc['task_handle']})"]


def _outbox_list(args: argparse.Namespace) -> int:
    return run(args, lambda p, c: dead_letters.list_outbox(c, operator=operator(args), status=args.status,
                                                           event_type=args.event_type, tenant_id=args.tenant_id,
                                                           limit=args.limit), human=_show_list)


def _outbox_redrive(args: argparse.Namespace) -> int:
    return run(args, lambda p, c: dead_letters.redrive_outbox(c, operator=operator(args), reason=args.reason,
                                                              event_ids=args.event_id, all_failed=args.all_failed,
                                                              event_type=args.event_type), human=_show_redrive)


def _queue_redrive(args: argparse.Namespace) -> int:
    # Its own transactions: the audit row commits before the move starts (dead_letters.redrive_queue).
    return run(args, lambda p, _: dead_letters.redrive_queue(p, _sqs(), operator=operator(args), queue=args.queue,
                                                             reason=args.reason, max_per_second=args.max_per_second),
               transaction=False, human=_show_queue)


def register(admin) -> None:
    ob = admin.add_parser("outbox", help="outbox dead letters (events that failed every delivery)").add_subparsers(
        dest="outbox_command", required=True)
    ls = add_common(ob.add_parser("list", help="events of one status, oldest first"))
    ls.add_argument("--status", default=outbox.FAILED, choices=[outbox.FAILED, outbox.PENDING, outbox.PUBLISHED],
                    help="which events")
    ls.add_argument("--event-type", default=None, help="only events of this type (e.g. TaskQueued)")
    ls.add_argument("--tenant-id", type=UUID, default=None)
    ls.add_argument("--limit", type=int, default=100)
    ls.set_defaults(fn=_outbox_list)
    rd = add_common(ob.add_parser("redrive", help="FAILED events back to PENDING, attempts reset, due now (audited)"))
    which = rd.add_mutually_exclusive_group(required=True)
    which.add_argument("--event-id", type=UUID, action="append", default=None, help="repeat for several")
    which.add_argument("--all-failed", action="store_true", help="every FAILED event (of --event-type)")
    rd.add_argument("--event-type", default=None, help="with --all-failed: only this type")
    rd.add_argument("--reason", required=True)
    rd.set_defaults(fn=_outbox_redrive)

    q = admin.add_parser("queue", help="SQS dead-letter queues (AWS)").add_subparsers(dest="queue_command", required=True)
    qr = add_common(q.add_parser("redrive", help="move a DLQ's messages back to their queue with SQS StartMessageMoveTask "
                                              "(audited)"))
    qr.add_argument("--queue", required=True, help="the queue's name or URL (or its DLQ's), e.g. aivedio-prod-settlement")
    qr.add_argument("--max-per-second", type=int, default=None, help="SQS's move rate (default: SQS's own, up to 500)")
    qr.add_argument("--reason", default=None)
    qr.set_defaults(fn=_queue_redrive)
