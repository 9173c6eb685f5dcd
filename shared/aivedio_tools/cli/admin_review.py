"""`aivedio admin review list|show|resolve`: tasks in MANUAL_REVIEW and their exits
(aivedio.attempts.review). A resolution is audited with its reason."""
from __future__ import annotations

import argparse
from uuid import UUID

from aivedio.attempts import review
from aivedio_tools.cli.common import add_common, operator, run


def _list(args: argparse.Namespace) -> int:
    def fn(platform, conn) -> dict:
        return review.list_reviews(conn, operator=operator(args), tenant_id=args.tenant_id, limit=args.limit)

    def human(doc: dict) -> str:
        lines = [f"{'task_id':<36}  {'reason':<26}  {'since':<25}  {'provider':<12}  job / last lookup"]
        for r in doc["items"]:
            lines.append(f"{r['task_id']:<36}  {(r['reason'] or '-'):<26}  {r['since'][:25]:<25}  {(r['provider'] or '-'):<12}  "
                         f"{r['provider_job_id'] or '(unknown)'} / {r['review_checked_at'] or 'never'}"
                         + ("  [cancel requested]" if r["cancel_requested_at"] else ""))
        lines.append(f"{doc['count']} shown, {doc['open']} in review")
        return "\n".join(lines) + "\n"

    return run(args, fn, human=human)


def _show(args: argparse.Namespace) -> int:
    def fn(platform, conn) -> dict:
        return review.show(conn, operator=operator(args), task_id=args.task_id, tenant_id=args.tenant_id)

    def human(doc: dict) -> str:
        t = doc["task"]
        lines = [f"task {t['task_id']} (tenant {t['tenant_id']}): {t['state']}, {t['error_code'] or '-'}",
                 f"  {t['error_message'] or ''}".rstrip(),
                 f"  held: {doc['held']['resources']} capacity, {doc['held']['credit']} credit, {doc['held']['budget']} budget"]
        for a in doc["attempts"]:
            lines.append(f"  attempt {a['attempt_no']} {a['attempt_id']}: {a['state']} {a['final_reason'] or ''} "
                         f"{a['provider']}/{a['provider_account']} job {a['provider_job_id'] or '(unknown)'}, "
                         f"looked up {a['review_checks']}x, last {a['review_checked_at'] or 'never'}")
        for o in doc["orphans"]:
            lines.append(f"  orphan {o['provider_job_id']}: {o['reason']} {o['resolution'] or 'open'}")
        for p in doc["parked_webhooks"]:
            lines.append(f"  parked webhook {p['webhook_id']}: {p['event_type']} {p['state']}")
        for a in doc["audit"]:
            lines.append(f"  {a['created_at']} {a['operator']} {a['action']}: {a['reason'] or ''}")
        return "\n".join(line for line in lines if line) + "\n"

    return run(args, fn, human=human)


def _resolve(args: argparse.Namespace) -> int:
    def fn(platform, _) -> dict:
        return review.resolve(platform, operator=operator(args), task_id=args.task_id, action=args.action, reason=args.reason,
                              provider_job_id=args.provider_job_id, confirm_absent=args.confirm_absent,
                              tenant_id=args.tenant_id)

    def human(doc: dict) -> str:
        return (f"task {doc['task_id']}: {doc['action']} -> task {doc['task_state']}, attempt {doc['attempt_state']}"
                + (f", job {doc['provider_job_id']}" if doc.get("provider_job_id") else "")
                + (f" ({doc['proof']})" if doc.get("proof") else "")
                + (f"; kept as orphans: {', '.join(doc['orphans'])}" if doc.get("orphans") else "") + "\n")

    return run(args, fn, transaction=False, human=human)


def register(admin) -> None:
    group = admin.add_parser("review", help="tasks in MANUAL_REVIEW: list, show, resolve").add_subparsers(
        dest="review_command", required=True)
    ls = add_common(group.add_parser("list", help="tasks in MANUAL_REVIEW, oldest first"))
    ls.add_argument("--tenant-id", type=UUID, default=None)
    ls.add_argument("--limit", type=int, default=100)
    ls.set_defaults(fn=_list)
    sh = add_common(group.add_parser("show", help="one task's review: reason, attempts, what it holds, audit"))
    sh.add_argument("--task-id", required=True, type=UUID)
    sh.add_argument("--tenant-id", type=UUID, default=None)
    sh.set_defaults(fn=_show)
    rs = add_common(group.add_parser("resolve", help="adopt the job, requeue (absence proven or confirmed), or fail the "
                                                     "task (audited)"))
    rs.add_argument("--task-id", required=True, type=UUID)
    rs.add_argument("--tenant-id", type=UUID, default=None)
    rs.add_argument("--action", required=True, choices=review.ACTIONS,
                    help="adopt the provider's job, requeue (absence proven), or fail the task")
    rs.add_argument("--provider-job-id", default=None, help="adopt: the provider's job id")
    rs.add_argument("--reason", required=True, help="why, for the audit log")
    rs.add_argument("--confirm-absent", action="store_true",
                    help="requeue: the operator confirms that no job exists, where no lookup can prove it (needed "
                         "too when the attempt's job id is known; that job is then kept as an orphan)")
    rs.set_defaults(fn=_resolve)
