"""Dead letters: outbox events that failed every delivery, and the SQS DLQs in AWS.

- `aivedio admin outbox list|redrive`, as an operator types them: list needs outbox.read, redrive
  outbox.redrive; a refusal writes nothing; a redrive puts FAILED rows back to PENDING with their
  attempts reset and due now, one audit row each with the reason, and the relay then delivers them;
- room service `outbox-dead-letters`: the OutboxDeadLetters gauge on every run (0 included) and an
  ALERT line while there are any, and it never redrives on its own;
- `aivedio admin queue redrive`: the StartMessageMoveTask request from a DLQ's ARN to its source
  queue's, found through the source's RedrivePolicy (moto plays the queues; moto 5 does not
  implement StartMessageMoveTask itself, so that one call is recorded, not executed); its audit row
  is committed before the move starts, and a move SQS refuses is audited as FAILED and reported."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from aivedio import outbox
from aivedio.admin import dead_letters
from aivedio_tools.cli import admin_outbox as dead_letters_cli
from aivedio.config import Limits, PlatformConfig
from aivedio.errors import DomainError
from aivedio.metrics_catalog import OUTBOX_DEAD_LETTERS
from aivedio.observability import metrics, publish
from aivedio.reconcile import outbox_dead_letters as svc
from aivedio.reconcile import room
from tests.billing_support import NOBODY, Cli
from tests.conftest import create_test_database, drop_test_database

pytestmark = pytest.mark.timeout(120)
OPS = "op:ops"


@pytest.fixture
def db_url():
    url = create_test_database("dead_letters")
    yield url
    drop_test_database(url)


@pytest.fixture
def p(make_platform, conn):
    return make_platform(PlatformConfig(limits=Limits(outbox_max_attempts=1)), redis=False)


def dead_letters_of(p, types: list[str]) -> list[str]:
    """One event of each type, failed on its one delivery: FAILED."""
    ids = [p.db.transaction(lambda c: str(outbox.write_event(c, t, aggregate_type="test", aggregate_id=None, tenant_id=None,
                                                             payload={"n": i}))) for i, t in enumerate(types)]  # in order

    def refuse(envelope):
        raise ConnectionError("queue unreachable")

    outbox.relay_once(p, refuse, batch=100)
    return ids


def status_of(conn, event_id) -> dict:
    return conn.execute("select status, attempts, next_retry_at <= now() as due, last_error from outbox_event where event_id = %s",
                        (event_id,)).fetchone()


def test_list_and_redrive_as_an_operator_types_them(p, conn, db_url, monkeypatch, capsys):
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    cli = Cli(monkeypatch)
    a, b, c = dead_letters_of(p, ["TaskSucceeded", "TaskFailed", "TaskSucceeded"])
    assert all(status_of(conn, i)["status"] == "FAILED" for i in (a, b, c))

    def aivedio(*argv: str, operator: str) -> tuple[int, dict]:
        code = cli.main([*argv, "--json", "--operator", operator])
        return code, json.loads(capsys.readouterr().out)

    # The CLI is trusted: any --operator lists (it only names who acts).
    code, listed = aivedio("admin", "outbox", "list", "--status", "FAILED", operator=NOBODY)
    assert code == 0 and listed["dead_letters"] == 3 and [e["event_id"] for e in listed["events"]] == [a, b, c]
    assert listed["events"][0]["last_error"].startswith("ConnectionError") and listed["events"][0]["attempts"] == 1
    code, listed = aivedio("admin", "outbox", "list", "--event-type", "TaskFailed", "--limit", "5", operator=OPS)
    assert code == 0 and [e["event_id"] for e in listed["events"]] == [b]

    assert conn.execute("select count(*) as n from audit_log where action = 'outbox.redrive'").fetchone()["n"] == 0

    # One by id (and an id that is not a dead letter: reported, left alone).
    pending = p.db.transaction(lambda cx: str(outbox.write_event(cx, "TaskQueued", aggregate_type="test", aggregate_id=None,
                                                                 tenant_id=None, payload={})))
    code, done = aivedio("admin", "outbox", "redrive", "--event-id", a, "--event-id", pending, "--reason", "queue fixed",
                         operator=OPS)
    assert code == 0 and done["redriven"] == 1 and done["not_failed"] == [pending]
    assert done["events"][0]["attempts_before"] == 1
    row = status_of(conn, a)
    assert (row["status"], row["attempts"], row["due"]) == ("PENDING", 0, True)
    # The rest of one type.
    code, done = aivedio("admin", "outbox", "redrive", "--all-failed", "--event-type", "TaskSucceeded", "--reason", "r2",
                         operator=OPS)
    assert code == 0 and [e["event_id"] for e in done["events"]] == [c]
    assert status_of(conn, b)["status"] == "FAILED"  # another type: untouched
    audits = conn.execute("""select operator, target, old_value, new_value, reason from audit_log
                              where action = 'outbox.redrive' order by audit_id""").fetchall()
    assert [(x["operator"], x["target"], x["reason"]) for x in audits] == [
        (OPS, f"outbox_event:{a}", "queue fixed"), (OPS, f"outbox_event:{c}", "r2")]
    assert audits[0]["old_value"]["status"] == "FAILED" and audits[0]["old_value"]["last_error"].startswith("ConnectionError")

    # Bad input is refused before anything is written.
    code, bad = aivedio("admin", "outbox", "redrive", "--all-failed", "--reason", " ", operator=OPS)
    assert (code, bad["error"]) == (1, "VALIDATION_ERROR")

    # The relay now delivers the redriven ones (a fresh set of attempts), and only those.
    delivered = []
    outbox.relay_once(p, lambda envelope: delivered.append(envelope["event_id"]), batch=100)
    assert set(delivered) == {a, c, pending}
    assert status_of(conn, a)["status"] == "PUBLISHED" and status_of(conn, a)["last_error"] is None

    # Human output is a table, not a dict.
    assert cli.main(["admin", "outbox", "list", "--operator", OPS]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "1 FAILED event(s) shown, 1 FAILED in all"
    assert b in out and "{" not in out


def test_the_installed_command_lists_dead_letters(p, db_url):
    dead_letters_of(p, ["TaskFailed"])
    exe = Path(sys.executable).with_name("aivedio")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "aivedio_tools.cli"]
    env = {"AIVEDIO_DATABASE_URL": db_url, "AIVEDIO_REDIS_URL": "none", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*cmd, "admin", "outbox", "list", "--json", "--operator", OPS], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # exactly one JSON document
    assert doc["dead_letters"] == 1 and doc["events"][0]["event_type"] == "TaskFailed"


def alerts(caplog) -> list:
    return [r for r in caplog.records if r.getMessage().startswith("ALERT outbox dead letters")]


def test_the_service_counts_and_alerts_and_never_redrives(p, conn, caplog, monkeypatch):
    published = []

    def recorded(spec, value, **dims):
        published.append((spec.name, value))
        publish(spec, value, **dims)

    monkeypatch.setattr(svc, "publish", recorded)
    clean = room.run(p, svc.NAME)
    assert clean.details["dead_letters"] == 0 and alerts(caplog) == []
    # 0 is published too: the CDK alarm treats a missing datapoint as the service not running.
    assert published == [(OUTBOX_DEAD_LETTERS.name, 0)]
    ids = dead_letters_of(p, ["TaskSucceeded", "TaskSucceeded", "TaskDispatchRequested"])
    before = metrics.snapshot().get(OUTBOX_DEAD_LETTERS.name, 0)
    report = room.run(p, svc.NAME)
    assert report.details["dead_letters"] == 3 and report.repaired == 0
    assert report.details["by_event_type"] == {"TaskDispatchRequested": 1, "TaskSucceeded": 2}
    assert metrics.snapshot()[OUTBOX_DEAD_LETTERS.name] - before == 3  # the gauge's value this run
    [alert] = alerts(caplog)
    assert alert.levelname == "ERROR" and alert.dead_letters == 3 and "aivedio admin outbox redrive" in alert.redrive
    assert all(status_of(conn, i)["status"] == "FAILED" for i in ids)  # it never redrives
    assert outbox.dead_letter_count(conn) == 3


# --- SQS dead-letter queues ----------------------------------------------------------------------------

class Recorded:
    """The moto client, with StartMessageMoveTask (which moto 5 does not implement) recorded; before
    each, `before_move()` runs (what is committed by then), and `refuse` makes SQS refuse it."""

    def __init__(self, client):
        self._client, self.moves, self.before_move, self.refuse = client, [], lambda: None, False

    def __getattr__(self, name):
        return getattr(self._client, name)

    def start_message_move_task(self, **request):
        self.before_move()
        if self.refuse:
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "not authorized to move messages"}},
                              "StartMessageMoveTask")
        self.moves.append(request)
        return {"TaskHandle": "handle-1"}


@pytest.fixture
def sqs(monkeypatch):
    for k, v in {"AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(k, v)
    with mock_aws():
        client = boto3.client("sqs")
        dlq = client.create_queue(QueueName="aivedio-dev-settlement-dlq")["QueueUrl"]
        dlq_arn = client.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        client.create_queue(QueueName="aivedio-dev-settlement", Attributes={
            "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": 5})})
        client.send_message(QueueUrl=dlq, MessageBody="{}")
        client.send_message(QueueUrl=dlq, MessageBody="{}")
        yield Recorded(client)


def test_queue_redrive_moves_the_dlq_back_to_its_source(p, conn, sqs, db_url, monkeypatch, capsys):
    source_arn = "arn:aws:sqs:us-east-1:123456789012:aivedio-dev-settlement"
    dlq_arn = source_arn + "-dlq"
    request, found = dead_letters.move_request(sqs, "aivedio-dev-settlement", max_per_second=10)
    assert request == {"SourceArn": dlq_arn, "DestinationArn": source_arn, "MaxNumberOfMessagesPerSecond": 10}
    assert found["messages"] == 2
    assert dead_letters.move_request(sqs, "aivedio-dev-settlement-dlq")[0] == {"SourceArn": dlq_arn, "DestinationArn": source_arn}
    with pytest.raises(DomainError) as e:
        dead_letters.move_request(sqs, "aivedio-dev-nope")
    assert e.value.code == "QUEUE_NOT_FOUND"

    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    monkeypatch.setattr(dead_letters_cli, "_sqs", lambda: sqs)
    cli = Cli(monkeypatch)
    argv = ["admin", "queue", "redrive", "--queue", "aivedio-dev-settlement", "--reason", "consumer fixed", "--json"]
    audited = []  # what another connection sees committed when the move starts
    sqs.before_move = lambda: audited.extend(conn.execute(
        "select new_value ->> 'status' as status from audit_log where action = 'queue.redrive' order by audit_id").fetchall())
    assert cli.main([*argv, "--operator", OPS]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sqs.moves == [{"SourceArn": dlq_arn, "DestinationArn": source_arn}]
    assert (doc["task_handle"], doc["messages"], doc["source"]) == ("handle-1", 2, source_arn)
    assert [a["status"] for a in audited] == ["REQUESTED"]  # audited and committed before the move started
    rows = conn.execute("""select operator, target, reason, new_value from audit_log where action = 'queue.redrive'
                            order by audit_id""").fetchall()
    assert [(a["operator"], a["target"], a["reason"]) for a in rows] == [(OPS, f"sqs:{dlq_arn}", "consumer fixed")] * 2
    assert [a["new_value"]["status"] for a in rows] == ["REQUESTED", "STARTED"]
    assert (rows[0]["new_value"]["dlq"], rows[0]["new_value"]["source"]) == (dlq_arn, source_arn)
    assert rows[1]["new_value"]["task_handle"] == "handle-1"

    # SQS refuses the move: the intent row stays, a second row says it failed, and the error is returned.
    sqs.refuse, sqs.before_move = True, lambda: None
    assert cli.main([*argv, "--operator", OPS]) == 1
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "QUEUE_MOVE_FAILED" and "not authorized" in err["details"]["error"]
    assert len(sqs.moves) == 1
    rows = conn.execute("""select new_value from audit_log where action = 'queue.redrive' order by audit_id""").fetchall()
    assert [a["new_value"]["status"] for a in rows] == ["REQUESTED", "STARTED", "REQUESTED", "FAILED"]
    assert "not authorized" in rows[-1]["new_value"]["error"]
