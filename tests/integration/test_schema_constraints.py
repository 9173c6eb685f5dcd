"""The schema itself refuses what must never be stored, whatever the application does.

Each test writes straight SQL against a freshly migrated database and asserts the precise
psycopg error class (and, where it names one, the constraint)."""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from psycopg import errors


# --- fixture rows -----------------------------------------------------------------------------

def make_tenant(conn: psycopg.Connection, service_class: str = "PAID_SHARED") -> dict:
    """A tenant with one user. Returns {tenant_id, user_id}."""
    t = conn.execute(
        "insert into tenant (name, service_class) values (%s, %s) returning tenant_id",
        (f"tenant-{uuid.uuid4().hex[:10]}", service_class),
    ).fetchone()
    u = conn.execute(
        "insert into app_user (tenant_id, name) values (%s, 'alice') returning user_id", (t["tenant_id"],)
    ).fetchone()
    return {"tenant_id": t["tenant_id"], "user_id": u["user_id"]}


def make_wallet(conn: psycopg.Connection, tenant_id, account_type: str = "PREPAID", credit_limit: int = 0) -> uuid.UUID:
    return conn.execute(
        """insert into wallet_account (tenant_id, account_type, unit_code, credit_limit_amount)
           values (%s, %s, 'CREDIT', %s) returning wallet_id""",
        (tenant_id, account_type, credit_limit),
    ).fetchone()["wallet_id"]


def make_task(conn: psycopg.Connection, tenant: dict, idempotency_key: str | None = None, **over) -> uuid.UUID:
    row = {
        "tenant_id": tenant["tenant_id"], "user_id": tenant["user_id"], "queue_class": "PAID_SHARED",
        "priority_band": 2, "resource_class": "video-standard", "model_code": "video-model-x",
        "fairness_units": 1, "provider_slot_units": 1, "estimated_cost_units": 10, "policy_version": 1,
        "estimate_version": 1, "idempotency_key": uuid.uuid4().hex if idempotency_key is None else idempotency_key, "mode": "text_to_video",
        "prompt": "a red fox in snow", "duration_seconds": 5, "resolution": "720p",
    }
    row.update(over)
    cols = ", ".join(row)
    params = ", ".join(["%s"] * len(row))
    return conn.execute(
        f"insert into generation_task ({cols}) values ({params}) returning task_id", list(row.values())
    ).fetchone()["task_id"]


def make_attempt(conn: psycopg.Connection, task_id, attempt_no: int = 1, provider_request_key: str | None = None,
                 provider: str = "provider-a", provider_job_id: str | None = None) -> uuid.UUID:
    # tenant_id and model_code are left out on purpose: the schema fills them from the task
    return conn.execute(
        """insert into task_attempt (task_id, attempt_no, provider, provider_account, provider_request_key,
                                     provider_job_id, state)
           values (%s, %s, %s, 'account-01', %s, %s, 'DISPATCHING') returning attempt_id""",
        (task_id, attempt_no, provider, provider_request_key or uuid.uuid4().hex, provider_job_id),
    ).fetchone()["attempt_id"]


def make_price(conn: psycopg.Connection, product: str = "video-model-x") -> uuid.UUID:
    return conn.execute(
        """insert into price_book (product_code, effective_from, currency_or_unit, rules)
           values (%s, %s, 'CREDIT', %s) returning price_version_id""",
        (product, datetime.now(timezone.utc) - timedelta(days=1, microseconds=uuid.uuid4().int % 10**6),
         json.dumps({"per_second": 20})),
    ).fetchone()["price_version_id"]


def post_ledger(conn: psycopg.Connection, wallet_id, business_key: str, event_type: str,
                entries: list[tuple[str, int]], **cols) -> uuid.UUID:
    """One ledger transaction with its entries, in one database transaction."""
    with conn.transaction():
        return _insert_ledger(conn, wallet_id, business_key, event_type, entries, **cols)


def _insert_ledger(conn, wallet_id, business_key, event_type, entries, **cols):
    names = ["wallet_id", "business_key", "event_type", *cols]
    txn_id = conn.execute(
        f"insert into ledger_transaction ({', '.join(names)}) values ({', '.join(['%s'] * len(names))})"
        " returning ledger_txn_id",
        [wallet_id, business_key, event_type, *cols.values()],
    ).fetchone()["ledger_txn_id"]
    for bucket, delta in entries:
        conn.execute(
            "insert into ledger_entry (ledger_txn_id, bucket, amount_delta) values (%s, %s, %s)",
            (txn_id, bucket, delta),
        )
    return txn_id


def grant(conn, wallet_id, amount: int) -> uuid.UUID:
    """GRANT: AVAILABLE +amount / ISSUED -amount, and the snapshot moved with it."""
    with conn.transaction():
        txn = _insert_ledger(conn, wallet_id, f"grant:{uuid.uuid4().hex}", "GRANT",
                             [("AVAILABLE", amount), ("ISSUED", -amount)])
        conn.execute("update wallet_account set available_amount = available_amount + %s where wallet_id = %s",
                     (amount, wallet_id))
    return txn


def make_reservation(conn, tenant: dict, wallet_id, reserved: int = 100) -> uuid.UUID:
    task_id = make_task(conn, tenant)
    return conn.execute(
        """insert into credit_reservation (wallet_id, task_id, quoted_amount, reserved_amount, price_version_id)
           values (%s, %s, %s, %s, %s) returning reservation_id""",
        (wallet_id, task_id, reserved, reserved, make_price(conn)),
    ).fetchone()["reservation_id"]


def make_shard(conn, capacity: int = 10, used: int = 0) -> str:
    key = f"provider:provider-a:video-model-x:us:{uuid.uuid4().hex[:6]}"
    conn.execute(
        "insert into resource_pool_shard (resource_key, shard_no, capacity_units, used_units) values (%s, 0, %s, %s),"
        " (%s, 1, %s, %s)",
        (key, capacity, used, key, capacity, used),
    )
    return key


def _constraint(exc: pytest.ExceptionInfo) -> str | None:
    return exc.value.diag.constraint_name


# --- wallets ----------------------------------------------------------------------------------

def test_prepaid_and_subscription_balances_never_go_negative(conn):
    t = make_tenant(conn)
    prepaid = make_wallet(conn, t["tenant_id"], "PREPAID")
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update wallet_account set available_amount = -1 where wallet_id = %s", (prepaid,))
    assert _constraint(e) == "wallet_account_prepaid_nonneg"

    sub = make_wallet(conn, t["tenant_id"], "SUBSCRIPTION")
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update wallet_account set available_amount = -1 where wallet_id = %s", (sub,))
    assert _constraint(e) == "wallet_account_subscription_nonneg"


def test_postpaid_may_go_negative_only_within_its_credit_limit(conn):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"], "POSTPAID", credit_limit=500)
    conn.execute("update wallet_account set available_amount = -500 where wallet_id = %s", (w,))
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update wallet_account set available_amount = -501 where wallet_id = %s", (w,))
    assert _constraint(e) == "wallet_account_postpaid_within_credit"


def test_negative_reserved_amount_is_rejected(conn):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update wallet_account set reserved_amount = -1 where wallet_id = %s", (w,))
    assert _constraint(e) == "wallet_account_reserved_nonneg"
    r = make_reservation(conn, t, w)
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update credit_reservation set reserved_amount = -1 where reservation_id = %s", (r,))
    assert _constraint(e) == "credit_reservation_reserved_nonneg"


def test_one_wallet_per_tenant_unit_and_type(conn):
    t = make_tenant(conn)
    make_wallet(conn, t["tenant_id"], "PREPAID")
    with pytest.raises(errors.UniqueViolation):
        make_wallet(conn, t["tenant_id"], "PREPAID")


# --- ledger -----------------------------------------------------------------------------------

def test_balanced_grant_commits(conn):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    txn = grant(conn, w, 1000)
    head = conn.execute("select * from ledger_transaction where ledger_txn_id = %s", (txn,)).fetchone()
    assert head["event_type"] == "GRANT" and head["tenant_id"] == t["tenant_id"]
    entries = conn.execute(
        "select bucket, amount_delta, wallet_id, tenant_id, unit_code from ledger_entry where ledger_txn_id = %s"
        " order by bucket", (txn,),
    ).fetchall()
    # wallet_id, tenant_id and unit_code were filled from the transaction and its wallet
    assert entries == [
        {"bucket": "AVAILABLE", "amount_delta": 1000, "wallet_id": w, "tenant_id": t["tenant_id"], "unit_code": "CREDIT"},
        {"bucket": "ISSUED", "amount_delta": -1000, "wallet_id": w, "tenant_id": t["tenant_id"], "unit_code": "CREDIT"},
    ]
    assert conn.execute("select available_amount from wallet_account where wallet_id = %s",
                        (w,)).fetchone()["available_amount"] == 1000


def test_unbalanced_transaction_is_rejected_at_commit(conn):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    key = f"grant:{uuid.uuid4().hex}"
    inserted = False
    with pytest.raises(errors.CheckViolation) as e:
        with conn.transaction():
            _insert_ledger(conn, w, key, "GRANT", [("AVAILABLE", 100), ("ISSUED", -99)])
            inserted = True  # each statement passed; only the commit checks the sum
    assert inserted
    assert _constraint(e) == "ledger_entry_balanced"
    assert conn.execute("select count(*) as n from ledger_transaction where business_key = %s",
                        (key,)).fetchone()["n"] == 0


def test_transaction_without_entries_is_rejected_at_commit(conn):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    with pytest.raises(errors.CheckViolation) as e:
        with conn.transaction():
            _insert_ledger(conn, w, f"grant:{uuid.uuid4().hex}", "GRANT", [])
    assert _constraint(e) == "ledger_transaction_has_entries"


def test_zero_entry_and_unknown_bucket_or_event_are_rejected(conn):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    for entries, event, name in [
        ([("AVAILABLE", 0)], "GRANT", "ledger_entry_amount_nonzero"),
        ([("BONUS", 5), ("ISSUED", -5)], "GRANT", "ledger_entry_bucket_check"),
        ([("AVAILABLE", 5), ("ISSUED", -5)], "GIFT", "ledger_transaction_event_type_check"),
    ]:
        with pytest.raises(errors.CheckViolation) as e:
            post_ledger(conn, w, f"k:{uuid.uuid4().hex}", event, entries)
        assert _constraint(e) == name


def test_duplicate_business_key_in_a_wallet_is_rejected(conn):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    key = f"compensate:{uuid.uuid4().hex}"
    post_ledger(conn, w, key, "COMPENSATE", [("AVAILABLE", 10), ("ISSUED", -10)])
    with pytest.raises(errors.UniqueViolation) as e:
        post_ledger(conn, w, key, "COMPENSATE", [("AVAILABLE", 10), ("ISSUED", -10)])
    assert _constraint(e) == "ledger_transaction_wallet_business_key"
    # the same key in another wallet is a different business effect
    other = make_wallet(conn, make_tenant(conn)["tenant_id"])
    post_ledger(conn, other, key, "COMPENSATE", [("AVAILABLE", 10), ("ISSUED", -10)])


@pytest.mark.parametrize("table", ["ledger_transaction", "ledger_entry"])
def test_ledger_rows_cannot_be_updated_or_deleted(conn, table):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    txn = grant(conn, w, 50)
    with pytest.raises(errors.RaiseException, match="append-only"):
        if table == "ledger_entry":
            conn.execute("update ledger_entry set amount_delta = amount_delta * 2 where ledger_txn_id = %s", (txn,))
        else:
            conn.execute("update ledger_transaction set reason_code = 'oops' where ledger_txn_id = %s", (txn,))
    with pytest.raises(errors.RaiseException, match="append-only"):
        conn.execute(f"delete from {table} where ledger_txn_id = %s", (txn,))
    with pytest.raises(errors.RaiseException, match="append-only"):
        conn.execute(f"truncate {table} cascade")
    assert conn.execute(f"select count(*) as n from {table} where ledger_txn_id = %s", (txn,)).fetchone()["n"] >= 1


def test_audit_log_and_provider_cost_events_are_append_only(conn):
    a = conn.execute("insert into audit_log (operator, action, target) values ('ops', 'policy.update', 'x')"
                     " returning audit_id").fetchone()["audit_id"]
    c = conn.execute(
        """insert into provider_cost_event (provider, provider_account_id, external_charge_id, event_type, amount,
                                            currency, source, occurred_at)
           values ('provider-a', 'account-01', %s, 'CHARGE', 0.42, 'USD', 'CALLBACK', now())
           returning cost_event_id""", (uuid.uuid4().hex,),
    ).fetchone()["cost_event_id"]
    for stmt, arg in [
        ("update audit_log set reason = 'edited' where audit_id = %s", a),
        ("delete from audit_log where audit_id = %s", a),
        ("update provider_cost_event set amount = 0 where cost_event_id = %s", c),
        ("delete from provider_cost_event where cost_event_id = %s", c),
    ]:
        with pytest.raises(errors.RaiseException, match="append-only"):
            conn.execute(stmt, (arg,))


def test_an_entry_cannot_be_added_to_a_committed_transaction(conn):
    """Migration 0230: entries belong to their transaction's database transaction (created_xid in
    the entry's key), so a balanced transaction cannot be unbalanced later, nor a pair slipped in."""
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    txn = grant(conn, w, 100)
    for later in ([("AVAILABLE", 5)], [("AVAILABLE", 5), ("ISSUED", -5)]):
        with pytest.raises(errors.ForeignKeyViolation):
            with conn.transaction():
                for bucket, delta in later:
                    conn.execute("insert into ledger_entry (ledger_txn_id, bucket, amount_delta) values (%s, %s, %s)",
                                 (txn, bucket, delta))
    assert conn.execute("select count(*) as n from ledger_entry where ledger_txn_id = %s", (txn,)).fetchone()["n"] == 2


def test_entry_must_belong_to_its_transactions_wallet(conn):
    t = make_tenant(conn)
    w1 = make_wallet(conn, t["tenant_id"], "PREPAID")
    w2 = make_wallet(conn, t["tenant_id"], "SUBSCRIPTION")
    with pytest.raises(errors.ForeignKeyViolation):
        with conn.transaction():
            txn = conn.execute(
                "insert into ledger_transaction (wallet_id, business_key, event_type) values (%s, 'g', 'GRANT')"
                " returning ledger_txn_id", (w1,),
            ).fetchone()["ledger_txn_id"]
            conn.execute("insert into ledger_entry (ledger_txn_id, wallet_id, bucket, amount_delta)"
                         " values (%s, %s, 'AVAILABLE', 5), (%s, %s, 'ISSUED', -5)", (txn, w2, txn, w2))


# --- credit reservations, lots, refunds --------------------------------------------------------

def test_settled_plus_released_cannot_exceed_reserved(conn):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    r = make_reservation(conn, t, w, reserved=120)
    conn.execute("update credit_reservation set settled_amount = 90, released_amount = 30, state = 'SETTLED'"
                 " where reservation_id = %s", (r,))
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update credit_reservation set released_amount = 31 where reservation_id = %s", (r,))
    assert _constraint(e) == "credit_reservation_settled_released_le_reserved"
    # tenant_id was filled from the wallet
    assert conn.execute("select tenant_id from credit_reservation where reservation_id = %s",
                        (r,)).fetchone()["tenant_id"] == t["tenant_id"]


def test_refund_cannot_exceed_settled(conn):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    r = make_reservation(conn, t, w, reserved=100)
    conn.execute("update credit_reservation set settled_amount = 80, released_amount = 20 where reservation_id = %s", (r,))
    conn.execute("update credit_reservation set refunded_amount = 80 where reservation_id = %s", (r,))
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update credit_reservation set refunded_amount = 81 where reservation_id = %s", (r,))
    assert _constraint(e) == "credit_reservation_refunded_le_settled"

    lot = conn.execute(
        """insert into credit_lot (wallet_id, kind, original_amount, remaining_amount, source_business_key)
           values (%s, 'PAID', 100, 100, 'topup:1') returning lot_id""", (w,),
    ).fetchone()["lot_id"]
    settle = post_ledger(conn, w, f"settle:generation:{uuid.uuid4()}:1", "SETTLE",
                         [("RESERVED", -80), ("CONSUMED", 80)])
    conn.execute("insert into settlement_allocation (ledger_txn_id, lot_id, amount) values (%s, %s, 80)", (settle, lot))
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update settlement_allocation set refunded_amount = 81 where ledger_txn_id = %s", (settle,))
    assert _constraint(e) == "settlement_allocation_refunded_le_amount"
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("insert into refund_request (tenant_id, task_id, amount, requested_by)"
                     " select tenant_id, task_id, 0, 'ops' from credit_reservation where reservation_id = %s", (r,))
    assert _constraint(e) == "refund_request_amount_positive"


def test_credit_lot_parts_stay_within_original(conn):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    lot = conn.execute(
        """insert into credit_lot (wallet_id, kind, original_amount, remaining_amount, source_business_key)
           values (%s, 'PROMOTIONAL', 100, 100, 'promo:1') returning lot_id""", (w,),
    ).fetchone()["lot_id"]
    conn.execute("update credit_lot set remaining_amount = 40, reserved_amount = 60 where lot_id = %s", (lot,))
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update credit_lot set remaining_amount = 41 where lot_id = %s", (lot,))
    assert _constraint(e) == "credit_lot_parts_le_original"
    with pytest.raises(errors.UniqueViolation):
        conn.execute("insert into credit_lot (wallet_id, kind, original_amount, remaining_amount, source_business_key)"
                     " values (%s, 'PROMOTIONAL', 5, 5, 'promo:1')", (w,))


def test_reservation_allocation_settled_plus_released_within_amount(conn):
    t = make_tenant(conn)
    w = make_wallet(conn, t["tenant_id"])
    r = make_reservation(conn, t, w, reserved=50)
    lot = conn.execute("insert into credit_lot (wallet_id, kind, original_amount, remaining_amount)"
                       " values (%s, 'PAID', 50, 0) returning lot_id", (w,)).fetchone()["lot_id"]
    conn.execute("insert into reservation_allocation (reservation_id, lot_id, amount) values (%s, %s, 50)", (r, lot))
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update reservation_allocation set settled_amount = 30, released_amount = 21"
                     " where reservation_id = %s", (r,))
    assert _constraint(e) == "reservation_allocation_settled_released_le_amount"


# --- price book -------------------------------------------------------------------------------

def test_price_version_rules_are_immutable(conn):
    p = make_price(conn)
    for stmt in [
        "update price_book set rules = '{\"per_second\": 1}' where price_version_id = %s",
        "update price_book set effective_from = now() where price_version_id = %s",
        "update price_book set currency_or_unit = 'USD' where price_version_id = %s",
    ]:
        with pytest.raises(errors.RaiseException, match="immutable"):
            conn.execute(stmt, (p,))
    # closing or retiring a version is allowed
    conn.execute("update price_book set effective_to = now() + interval '1 day', status = 'RETIRED'"
                 " where price_version_id = %s", (p,))
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update price_book set status = 'ARCHIVED' where price_version_id = %s", (p,))
    assert _constraint(e) == "price_book_status_check"


# --- tasks ------------------------------------------------------------------------------------

def test_duplicate_idempotency_key_per_tenant_is_rejected(conn):
    a, b = make_tenant(conn), make_tenant(conn)
    make_task(conn, a, "key-1")
    with pytest.raises(errors.UniqueViolation) as e:
        make_task(conn, a, "key-1")
    assert _constraint(e) == "generation_task_tenant_idempotency_key"
    make_task(conn, b, "key-1")  # another tenant's key space


def test_task_state_band_and_units_are_checked(conn):
    t = make_tenant(conn)
    for over, name in [
        ({"state": "DONE"}, "generation_task_state_check"),
        ({"priority_band": 5, "base_priority_band": 2}, "generation_task_priority_band_check"),
        ({"priority_band": -1, "base_priority_band": 2}, "generation_task_priority_band_check"),
        ({"priority_band": 5}, "generation_task_base_priority_band_check"),  # inherits the band
        ({"fairness_units": -1}, "generation_task_fairness_units_check"),
        ({"gpu_units": -1}, "generation_task_gpu_units_check"),
        ({"queue_class": "VIP"}, "generation_task_queue_class_check"),
        ({"idempotency_key": ""}, "generation_task_idempotency_key_length"),
    ]:
        with pytest.raises(errors.CheckViolation) as e:
            make_task(conn, t, **over)
        assert _constraint(e) == name
    task = make_task(conn, t, priority_band=3)
    row = conn.execute("select state, base_priority_band from generation_task where task_id = %s", (task,)).fetchone()
    assert row == {"state": "QUEUED", "base_priority_band": 3}


def test_task_user_must_belong_to_the_tenant(conn):
    a, b = make_tenant(conn), make_tenant(conn)
    with pytest.raises(errors.ForeignKeyViolation):
        make_task(conn, {"tenant_id": a["tenant_id"], "user_id": b["user_id"]})


def test_idempotency_record_key_length(conn):
    t = make_tenant(conn)
    for key in ["", "k" * 256]:
        with pytest.raises(errors.CheckViolation) as e:
            conn.execute("insert into idempotency_record (tenant_id, idempotency_key, request_hash)"
                         " values (%s, %s, 'h')", (t["tenant_id"], key))
        assert _constraint(e) == "idempotency_record_key_length"
    conn.execute("insert into idempotency_record (tenant_id, idempotency_key, request_hash) values (%s, %s, 'h')",
                 (t["tenant_id"], "k" * 255))


# --- attempts, resources ----------------------------------------------------------------------

def test_duplicate_provider_request_key_is_rejected(conn):
    t = make_tenant(conn)
    task = make_task(conn, t)
    a1 = make_attempt(conn, task, 1, provider_request_key="req-1")
    row = conn.execute("select tenant_id, model_code, fencing_token from task_attempt where attempt_id = %s",
                       (a1,)).fetchone()
    assert row["tenant_id"] == t["tenant_id"] and row["model_code"] == "video-model-x"
    with pytest.raises(errors.UniqueViolation) as e:
        make_attempt(conn, task, 2, provider_request_key="req-1")
    assert _constraint(e) == "task_attempt_provider_request_key_key"
    with pytest.raises(errors.UniqueViolation) as e:
        make_attempt(conn, task, 1)
    assert _constraint(e) == "task_attempt_task_attempt_no_key"
    a2 = make_attempt(conn, task, 2)
    # fencing tokens are monotonic per attempt
    tokens = conn.execute("select fencing_token from task_attempt where attempt_id in (%s, %s) order by attempt_no",
                          (a1, a2)).fetchall()
    assert tokens[0]["fencing_token"] < tokens[1]["fencing_token"]


def test_duplicate_provider_job_id_per_account_is_rejected(conn):
    t = make_tenant(conn)
    task = make_task(conn, t)
    make_attempt(conn, task, 1, provider_job_id="job-1")
    make_attempt(conn, task, 2)  # NULL job ids do not collide
    make_attempt(conn, task, 3)
    with pytest.raises(errors.UniqueViolation) as e:
        make_attempt(conn, task, 4, provider_job_id="job-1")
    assert _constraint(e) == "task_attempt_provider_job_key"


def test_resource_shard_cannot_exceed_capacity_or_go_negative(conn):
    key = make_shard(conn, capacity=10)
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update resource_pool_shard set used_units = 11 where resource_key = %s and shard_no = 0", (key,))
    assert _constraint(e) == "resource_pool_shard_used_within_capacity"
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("update resource_pool_shard set used_units = -1 where resource_key = %s and shard_no = 0", (key,))
    assert _constraint(e) == "resource_pool_shard_used_nonneg"
    # the ch.18.9.3 conditional update returns no row when the shard is full
    conn.execute("update resource_pool_shard set used_units = 8 where resource_key = %s and shard_no = 0", (key,))
    got = conn.execute(
        """update resource_pool_shard set used_units = used_units + %s, version = version + 1, updated_at = now()
            where resource_key = %s and shard_no = 0 and used_units + %s <= capacity_units
           returning used_units""", (3, key, 3),
    ).fetchone()
    assert got is None


def test_one_reservation_per_attempt_and_resource(conn):
    t = make_tenant(conn)
    task = make_task(conn, t)
    attempt = make_attempt(conn, task)
    key = make_shard(conn)

    def reserve(shard_no: int, resource_key: str = key, units: int = 1) -> None:
        conn.execute(
            """insert into resource_reservation (task_id, attempt_id, tenant_id, resource_key, shard_no, reserved_units,
                                                 lease_until, fencing_token)
               values (%s, %s, %s, %s, %s, %s, now() + interval '5 minutes', 1)""",
            (task, attempt, t["tenant_id"], resource_key, shard_no, units),
        )

    reserve(0)
    with pytest.raises(errors.UniqueViolation) as e:
        reserve(1)  # another shard of the same resource for the same attempt
    assert _constraint(e) == "resource_reservation_pkey"
    conn.execute("update resource_reservation set state = 'RELEASED', released_at = now() where attempt_id = %s", (attempt,))
    with pytest.raises(errors.UniqueViolation) as e:
        reserve(1)  # released, the (attempt, resource) pair stays taken: a new claim is a new attempt
    assert _constraint(e) == "resource_reservation_pkey"
    with pytest.raises(errors.NotNullViolation):  # no trigger fills the tenant in: its one writer passes it
        conn.execute(
            """insert into resource_reservation (task_id, attempt_id, resource_key, shard_no, reserved_units, lease_until,
                                                 fencing_token)
               values (%s, %s, 'another', 0, 1, now(), 1)""", (task, attempt))
    with pytest.raises(errors.CheckViolation) as e:
        reserve(0, "other", units=0)
    assert _constraint(e) == "resource_reservation_units_positive"


# --- provider cost and reconciliation ---------------------------------------------------------

def test_duplicate_provider_cost_event_is_rejected(conn):
    def cost(charge_id, line_id=None, event_type="CHARGE"):
        conn.execute(
            """insert into provider_cost_event (provider, provider_account_id, external_charge_id, external_line_id,
                                                event_type, amount, currency, source, occurred_at)
               values ('provider-a', 'account-01', %s, %s, %s, 1.25, 'USD', 'INVOICE', now())""",
            (charge_id, line_id, event_type),
        )

    cost("ch-1")
    with pytest.raises(errors.UniqueViolation) as e:
        cost("ch-1")
    assert _constraint(e) == "provider_cost_event_charge_key"
    cost("ch-1", event_type="CREDIT_NOTE")  # another effect of the same charge
    cost("ch-2", line_id="line-1")
    with pytest.raises(errors.UniqueViolation) as e:
        cost("ch-3", line_id="line-1")
    assert _constraint(e) == "uq_provider_cost_event_line"


def test_reconciliation_run_once_per_source_and_known_discrepancy_types(conn):
    def run():
        return conn.execute(
            """insert into reconciliation_run (provider, billing_period, source_object_key, source_checksum)
               values ('provider-a', '[2026-06-24,2026-06-25)', 'invoices/2026-06-24.json', 'sha-1')
               returning run_id""",
        ).fetchone()["run_id"]

    run_id = run()
    with pytest.raises(errors.UniqueViolation):
        run()
    with pytest.raises(errors.CheckViolation) as e:
        conn.execute("insert into reconciliation_item (run_id, discrepancy_type, currency) values (%s, 'WEIRD', 'USD')",
                     (run_id,))
    assert _constraint(e) == "reconciliation_item_discrepancy_type_check"
    conn.execute("insert into reconciliation_item (run_id, discrepancy_type, currency) values (%s, 'LATE_CHARGE', 'USD')",
                 (run_id,))
