"""The health of the platform as one process sees it (what /healthz answers): each dependency
probed, and the degraded modes of aivedio.degraded brought up to date from what the probes find
(the outbox backlog, open circuit breakers, the stored modes)."""
from __future__ import annotations

from dataclasses import dataclass

from aivedio import outbox
from aivedio.degraded import (
    CAPACITY_COUNTERS,
    DATABASE,
    OUTBOX_BACKLOG,
    PROBED,
    PROVIDER_BREAKER,
    REDIS,
    STORED,
    Mode,
    active_modes,
    database_down,
    enter,
    leave,
    redis_down,
)
from aivedio.metrics_catalog import DEGRADED_MODE
from aivedio.observability import logger, publish
from aivedio.scheduling import router

PROBE_TIMEOUT_SECONDS = 2.0  # a dead database makes the probe answer "down" instead of hanging
MANUAL_REVIEW_OPEN = "select count(*) as n from generation_task where state = 'MANUAL_REVIEW'"


@dataclass
class Health:
    database: str  # ok | down
    redis: str  # ok | down | disabled (configured off: conservative mode by choice, not a fault)
    modes: list[Mode]
    outbox_pending: int | None = None  # None: the database could not be asked
    outbox_oldest_pending_seconds: float | None = None  # platform seconds
    outbox_dead_letters: int | None = None
    manual_review_open: int | None = None

    @property
    def status(self) -> str:
        return "degraded" if self.modes else "ok"


def _probe_outbox(platform, health: Health) -> None:
    st = outbox.outbox_state(platform)
    health.outbox_pending, health.outbox_oldest_pending_seconds = st.pending, round(st.oldest_age_seconds, 1)
    why = outbox.outbox_overload(platform, st)
    if why is None:
        leave(platform, OUTBOX_BACKLOG)
        return
    limits = platform.config.limits
    since = None
    if st.oldest_created_at is not None and st.oldest_age_seconds > limits.outbox_backlog_max_age_seconds:
        since = st.oldest_created_at + platform.clock.delta(limits.outbox_backlog_max_age_seconds)
    enter(platform, OUTBOX_BACKLOG, why, since=since, pending=st.pending, oldest_pending_seconds=round(st.oldest_age_seconds, 1))


def _probe_breakers(platform) -> None:
    open_ = router.open_breakers(platform)
    if not open_:
        leave(platform, PROVIDER_BREAKER)
        return
    accounts = [f"{p.name}:{a.account_id}" for p in platform.config.providers if p.name in open_ for a in p.accounts]
    enter(platform, PROVIDER_BREAKER,
          f"circuit breaker open for {', '.join(sorted(open_))}: no new attempts there; accepted jobs stay where they are",
          providers={name: {"failure_rate": round(1 - s.success_rate, 3), "samples": s.samples} for name, s in sorted(open_.items())},
          accounts=accounts)


def _probe_stored(platform, conn) -> None:
    rows = {r["mode"]: r for r in conn.execute(STORED).fetchall()}
    for mode in (CAPACITY_COUNTERS,):
        r = rows.get(mode)
        if r is None:
            leave(platform, mode)
        else:
            enter(platform, mode, r["reason"], since=r["since"], **(r["detail"] or {}))


def evaluate(platform) -> Health:
    """Probe every dependency this process can see, bring the registry up to date, and return the
    health of the platform as this process sees it (what /healthz answers)."""
    db_ok = platform.db.healthy(timeout=PROBE_TIMEOUT_SECONDS)
    if db_ok:
        leave(platform, DATABASE)
    else:
        database_down(platform)
    if platform.cache is None:
        redis = "disabled"
    else:
        redis = "ok" if platform.cache.healthy() else "down"
        if redis == "ok":
            leave(platform, REDIS)
        else:
            redis_down(platform, "no answer to PING")
    health = Health(database="ok" if db_ok else "down", redis=redis, modes=[])
    if db_ok:
        for probe in (lambda: _probe_outbox(platform, health), lambda: _probe_breakers(platform)):
            try:
                probe()
            except Exception as e:  # noqa: BLE001 - one failing probe must not hide the others
                logger.warning("degraded-mode probe failed", extra={"error": repr(e)})
        try:
            with platform.db.connection(timeout=PROBE_TIMEOUT_SECONDS) as conn:
                _probe_stored(platform, conn)
                health.outbox_dead_letters = outbox.dead_letter_count(conn)
                health.manual_review_open = int(conn.execute(MANUAL_REVIEW_OPEN).fetchone()["n"])
        except Exception as e:  # noqa: BLE001
            logger.warning("health figures unavailable", extra={"error": repr(e)})
    health.modes = active_modes(platform)
    return health


def publish_gauges(platform) -> Health:
    """Evaluate, then publish every probed mode's gauge, 1 or 0, so the dashboard's line is never
    empty (the redis-index service calls this each run)."""
    h = evaluate(platform)
    on = {m.mode for m in h.modes}
    for mode in PROBED:
        if mode == REDIS and platform.cache is None:
            continue
        publish(DEGRADED_MODE, 1 if mode in on else 0, mode=mode)
    return h
