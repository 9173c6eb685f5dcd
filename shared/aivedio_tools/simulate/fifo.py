"""The FIFO baseline: the fairness scheduler's yardstick, not a platform policy.

Same workload, same claim (`aivedio.scheduling.claim.claim`, with the same routes, resource keys and
borrowing rule), but no tenants: each lane takes its oldest queued task by enqueue_at (ties, such as
a backlog admitted at one instant, in index order), and when that task does not fit, the lane waits
for it (head-of-line). Head-of-line is per provider pool: a task whose routes have no free slot
(its model's accounts are full) holds back the lane's other tasks of that model only, and tasks of
models served by other accounts go on, as a FIFO queue per pool would. A task stopped only by its own
tenant's or user's running cap is passed over, since that cap is a contract limit and not a
scheduling choice."""
from __future__ import annotations

from dataclasses import dataclass

from aivedio.scheduling import router
from aivedio.scheduling.claim import ENTERPRISE, LENDER_KEY, NoRoom, claim
from aivedio.scheduling.scheduler import BORROWERS, LaneView

SCAN = 32  # queued tasks fetched per look at a lane's head


@dataclass
class FifoReport:
    claims: int = 0


class FifoPolicy:
    def __init__(self, platform):
        self.platform = platform
        self._ensured: set[tuple[str, int]] = set()

    def tick(self, lanes: list[str]) -> FifoReport:
        report = FifoReport()
        order = [lane for lane in self.platform.config.scheduler.lane_order if lane in lanes]
        for lane in order:
            report.claims += self._run_lane(lane)
        return report

    def _run_lane(self, lane: str) -> int:
        p = self.platform
        claimed = 0
        passed_over: set = set()
        full_models: set[str] = set()  # models whose provider accounts had no room: their heads wait
        while True:
            now = p.clock.now()
            with p.db.connection() as conn:
                view = LaneView(p, conn, lane)
                heads = conn.execute(
                    """select * from generation_task
                        where state = 'QUEUED' and queue_class = %s and next_eligible_at <= %s
                          and not (model_code = any(%s))
                        order by enqueue_at limit %s""",
                    (lane, now, list(full_models), SCAN + len(passed_over)),
                    prepare=False,  # a generic plan for queue_class = $1 scans the queue
                ).fetchall()
            heads = [h for h in heads if h["task_id"] not in passed_over]
            if not heads or not view.has_room:
                return claimed
            for task in heads:
                if task["model_code"] in full_models:
                    continue
                try:
                    p.db.transaction(lambda conn, task=task: self._claim(conn, task, view, now))
                except NoRoom as e:
                    if e.key == "task:moved":
                        continue
                    if e.tenant_bound:
                        passed_over.add(task["task_id"])
                        continue
                    if e.key.startswith("lane:") or e.key == LENDER_KEY:
                        return claimed  # head-of-line: the lane waits for its oldest task
                    full_models.add(task["model_code"])  # its pool waits for it; other pools go on
                    continue
                claimed += 1
                with p.db.connection() as conn:
                    view = LaneView(p, conn, lane)  # free units and borrowing room after this claim
                if not view.has_room:
                    return claimed

    def _claim(self, conn, task: dict, view: LaneView, now):
        policy = conn.execute("select * from tenant_scheduling_policy where tenant_id = %s", (task["tenant_id"],)).fetchone()
        tier = task["queue_class"] if task["queue_class"] in ("EXPENSIVE", "RECOVERY") else policy["service_class"]
        routes = router.route(self.platform, task, tier, conn=conn)
        if not routes:
            raise NoRoom("provider:none")
        lease = self.platform.clock.real_seconds(self.platform.config.timers.lease_seconds)
        options = [(f"lane:{task['queue_class']}", False)]
        if view.can_borrow and task["queue_class"] in BORROWERS:
            options.append((f"lane:{ENTERPRISE}", True))
        last: NoRoom | None = None
        for lane_key, borrowed in options:
            for r in routes:
                try:
                    return claim(conn, task, r, policy, lane_key=lane_key, borrowed=borrowed,
                                 shards=self.platform.config.limits.pool_shards, lease_seconds=lease, now=now,
                                 ensured=self._ensured)
                except NoRoom as e:
                    last = e
                    if e.tenant_bound or e.key == "task:moved":
                        raise
                    if e.key.startswith("lane:") or e.key == LENDER_KEY:
                        break
        raise last or NoRoom("provider:none")
