"""One process of a chaos run: `python -m aivedio_tools.chaos.node SPEC ROLE INDEX`.

The runner starts each as an OS process, so a fault can SIGKILL or SIGSTOP it like any crash. Its
roles, as the local runtime runs them (aivedio_tools.local.runtime):
- api: the tenant API (and webhooks) on the run's port, shared with the other api process through
  SO_REUSEPORT, as Lambda instances share an API Gateway stage;
- scheduler: the scheduler-tick loop (the first one also scheduler-maintenance);
- dispatcher: the outbox relay, whose local deliveries run the SQS consumers (dispatch, settlement,
  the queue indexer) in this process, the attempt workflows, and the lease scanner;
- reconciler: every other maintenance service.
Deliveries are repeated (1 to `max_copies` copies, the extra ones late, so in any order) as SQS
may deliver them; the safeguard switches and failpoints come through the environment."""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import psycopg

from aivedio.config import PlatformConfig, Settings
from aivedio.context import build_platform, set_platform
from aivedio.events_routing import SCHEDULES
from aivedio.observability import logger
from aivedio_tools.local.handlers import api_server
from aivedio_tools.local.runtime import LocalRuntime, Loop, scheduled

ROLE_LOOPS = {
    "scheduler": ("scheduler-tick",),
    "dispatcher": ("outbox-relay", "attempt-recovery"),
}
NOT_IN_CHAOS = ("media-dispatch", "media-jobs", "invoice-reconcile")  # media is off; invoices are not promised here
START_RETRIES = 5


def loops_of(role: str, index: int) -> tuple[str, ...]:
    if role == "reconciler":
        taken = {n for names in ROLE_LOOPS.values() for n in names} | {"scheduler-maintenance", *NOT_IN_CHAOS}
        return tuple(s.name for s in SCHEDULES if s.name not in taken)
    if role == "scheduler" and index == 0:
        return (*ROLE_LOOPS["scheduler"], "scheduler-maintenance")
    return ROLE_LOOPS.get(role, ())


def repeating(deliver, rng: random.Random, max_copies: int, rate: float):
    """Deliver once now (the relay marks the event published after it), and with probability
    `rate` 1 to max_copies - 1 more copies later, from a thread: a late copy arrives after newer
    events, as an SQS redelivery does."""
    lock = threading.Lock()

    def again(envelope: dict, copies: int, delays: list[float]) -> None:
        for d in delays:
            time.sleep(d)
            try:
                deliver(envelope)
            except Exception:  # noqa: BLE001 - a failed extra copy is one SQS would retry; the first copy counts
                logging.getLogger("aivedio").warning("repeated delivery failed", exc_info=True)

    def deliver_repeated(envelope: dict) -> None:
        deliver(envelope)
        with lock:
            extra = rng.randint(1, max_copies - 1) if max_copies > 1 and rng.random() < rate else 0
            delays = [rng.uniform(0.0, 2.0) for _ in range(extra)]
        if extra:
            threading.Thread(target=again, args=(envelope, extra, delays), daemon=True).start()

    return deliver_repeated


def main(argv: list[str]) -> int:
    spec_path, role, index = argv[0], argv[1], int(argv[2])
    spec: dict[str, Any] = json.loads(open(spec_path).read())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {role}-{index}[%(process)d] %(name)s %(message)s")

    logger.setLevel("WARNING")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = PlatformConfig.model_validate(spec["config"])
    platform = build_platform(Settings(**spec["settings"]), config, pool_size=spec["pool_size"])
    server = rt = None
    if role == "api":
        platform.extras["callback_base_url"] = spec["api_url"]
        set_platform(platform)
        server = api_server("127.0.0.1", spec["api_port"], reuse_port=True)
        server.start()
    else:
        names = loops_of(role, index)
        loops = [Loop(s.name, s.local_interval(config), scheduled(s.name, s.module, s.payload)) for s in SCHEDULES if s.name in names]
        platform.extras["callback_base_url"] = spec["api_url"]
        for attempt in range(START_RETRIES):  # a start racing claims can lose a deadlock in the config's bootstrap
            rt = LocalRuntime(platform, port=0, loops=loops, workflow_workers=spec["workflow_workers"], serve_api=False)
            try:
                rt.start()
                break
            except psycopg.errors.DeadlockDetected:
                rt.stop()
                if attempt == START_RETRIES - 1:
                    raise
        d = spec["deliveries"]
        platform.extras["outbox_deliver"] = repeating(platform.extras["outbox_deliver"],
                                                      random.Random(spec["delivery_seed"] + index * 7919),
                                                      d["max_copies"], d["rate"])
        platform.extras["callback_base_url"] = spec["api_url"]
    sys.stdout.write(json.dumps({"ready": f"{role}-{index}", "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    while not stop.wait(0.5):
        if os.getppid() == 1:  # the runner is gone: an orphan stops too
            break
    if server is not None:
        server.stop()
    if rt is not None:
        rt.stop()
    platform.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
