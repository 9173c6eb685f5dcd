"""A tenant's queue counts in a bounded number of rows (migration 0230, part 6; issue 15: many users
behind one tenant). The tenant-wide limits read tenant_queue_usage, 64 shards per lane, instead of
a row per user: the counts equal the queued tasks through every way a task enters or leaves the
queue, a tenant of more users than shards keeps at most 64 rows per lane, and its limit stays exact."""
from __future__ import annotations

import json
import uuid

import pytest

from aivedio.admission.cancel import cancel
from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from tests.admission_support import BODY, new_tenant, second_user

SHARDS = 64

TENANT_COUNTS_VS_TASKS = """
select coalesce(s.queue_class, t.queue_class) as queue_class, coalesce(s.tasks, 0) as usage_tasks,
       coalesce(s.units, 0) as usage_units, coalesce(t.n, 0) as tasks, coalesce(t.units, 0) as units, coalesce(s.rows, 0) as rows
  from (select queue_class, sum(queued_tasks) as tasks, sum(queued_units) as units, count(*) as rows
          from tenant_queue_usage where tenant_id = %(t)s group by 1) s
  full join (select queue_class, count(*) as n, sum(fairness_units) as units from generation_task
              where tenant_id = %(t)s and state = 'QUEUED' group by 1) t using (queue_class)
"""


def test_the_tenants_counts_equal_its_queued_tasks_in_at_most_64_rows_per_lane(platform, conn):
    t = new_tenant(platform, credits=100_000)
    users = [t] + [second_user(platform, t) for _ in range(89)]
    ids = [json.loads(admit(platform, u.caller, GenerationRequest(**BODY), BODY, uuid.uuid4().hex).body)["task_id"]
           for u in users for _ in range(2)]
    cancel(platform, t.caller, uuid.UUID(ids[0]))  # QUEUED -> CANCELLED
    conn.execute("update generation_task set state = 'DISPATCHING', version = version + 1 where task_id = %s", (ids[3],))
    conn.execute("update generation_task set state = 'DISPATCHING' where task_id = %s", (ids[5],))
    conn.execute("update generation_task set state = 'QUEUED' where task_id = %s", (ids[5],))  # a requeue
    conn.execute("update generation_task set queue_class = 'STANDARD', fairness_units = 3 where task_id = %s", (ids[7],))
    conn.execute("update generation_task set user_id = %s where task_id = %s", (users[1].user_id, ids[9]))  # another shard
    rows = conn.execute(TENANT_COUNTS_VS_TASKS, {"t": t.tenant_id}).fetchall()
    assert rows and all((r["usage_tasks"], r["usage_units"]) == (r["tasks"], r["units"]) for r in rows), rows
    assert sum(r["tasks"] for r in rows) == 180 - 2
    assert all(r["rows"] <= SHARDS for r in rows) and max(r["rows"] for r in rows) > 16  # 90 users, spread over shards


def test_a_tenant_of_many_users_is_held_exactly_to_its_queue_limit(platform, conn):
    t = new_tenant(platform, max_queued_tasks=25)
    users = [t] + [second_user(platform, t) for _ in range(39)]
    outcomes = []
    for u in users:
        try:
            outcomes.append(admit(platform, u.caller, GenerationRequest(**BODY), BODY, uuid.uuid4().hex).status)
        except Rejected as r:
            outcomes.append(r.decision)
    assert outcomes.count(202) == 25 and set(outcomes[25:]) == {"REJECT_TENANT_QUEUE_FULL"}
    queued = conn.execute("select count(*) as n from generation_task where tenant_id = %s and state = 'QUEUED'",
                          (t.tenant_id,)).fetchone()["n"]
    assert queued == 25
    with pytest.raises(Rejected) as e:
        admit(platform, users[-1].caller, GenerationRequest(**BODY), BODY, "one-more")
    assert e.value.decision == "REJECT_TENANT_QUEUE_FULL"
