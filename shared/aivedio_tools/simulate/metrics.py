"""The figures of issue 4's "Fairness must be measured, not assumed", computed from the task rows a
run left in PostgreSQL (all times in simulated platform seconds).

Delivery. A task delivers its cost units evenly over its run: u units over [start, end). Delivered
units in a window are the parts of runs inside it, so a long task counts where it actually ran.

Saturated windows. The run is cut into windows of `window_seconds`; a window is saturated for a lane
when the lane had queued work during all of it (the backlogged demand exceeded what was served).

Fair share (water-filling). In each saturated window the units the lane delivered are shared by
weight, but a tenant is capped at what it could have used: the units of its work that was running at
the window's start (at the rate it ran) plus, for every task it had queued or that arrived in the
window, what that task could have delivered had it started at once. Tenants under their share are
capped there and the rest is re-shared among the others.

Fairness error (Armada's): the sum over tenants of the shortfall below the fair share, as a fraction
of the total delivered, summed over all saturated windows. Jain's index is over x_i = delivered /
fair share (so 1.0 is perfectly weight-fair with capped tenants counted as fair).

Pools. A task's pool is the set of provider accounts able to run it (router.candidates: the model,
resolution and duration it asks for). Where the accounts' slots bind rather than the lane's units,
the shares that matter are those within a pool: the same figures are computed per lane and, under
`pools`, per (lane, pool), with saturation meaning the pool had queued work for the whole window.

Utilisation is of the binding capacity: at each moment some work is queued, the larger of the fill
of the provider accounts that queued work could run on (their slots in use over their
max_concurrency) and the lowest fill of a lane with queued work. So a run whose accounts are full
while its lane has units to spare is fully used, and one that leaves an account with waiting work
idle is not, whatever the other accounts do."""
from __future__ import annotations

import bisect
import math
from collections import defaultdict

from aivedio.scheduling.claim import ENTERPRISE
from aivedio.scheduling.resources import account_key
from aivedio.scheduling.router import candidates
from aivedio.scheduling.scheduler import BORROWERS
from aivedio_tools.simulate import checks
from aivedio_tools.simulate.scenarios import Scenario

EPS = 1e-9
TENANT_LIST_LIMIT = 40  # beyond this many tenants a lane's tenants are reported by group


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def wait_stats(waits: list[float]) -> dict:
    r = lambda x: None if x is None else round(x, 2)  # noqa: E731
    return {"n": len(waits), "p50": r(percentile(waits, 50)), "p95": r(percentile(waits, 95)),
            "p99": r(percentile(waits, 99)), "max": r(max(waits) if waits else None)}


def water_fill(total: float, weights: dict, caps: dict) -> dict:
    """Share `total` by weight, no one above its cap; the surplus of capped ones goes to the rest."""
    fair = {k: 0.0 for k in weights}
    active = {k for k in weights if caps.get(k, 0) > EPS}
    remaining = total
    while active and remaining > EPS:
        wsum = sum(weights[k] for k in active)
        level = remaining / wsum
        capped = [k for k in active if caps[k] - fair[k] <= level * weights[k] + EPS]
        if not capped:
            for k in active:
                fair[k] += level * weights[k]
            break
        for k in capped:
            remaining -= caps[k] - fair[k]
            fair[k] = caps[k]
            active.discard(k)
    return fair


def jain(xs: list[float]) -> float | None:
    if not xs:
        return None
    s, s2 = sum(xs), sum(x * x for x in xs)
    return (s * s) / (len(xs) * s2) if s2 > 0 else None


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


# -- the analysis of one run -----------------------------------------------------------------------------

class Run:
    def __init__(self, scenario: Scenario, prep: dict, data: dict, stats):
        self.sc, self.prep, self.stats = scenario, prep, stats
        self.end = data["end"]
        self.by_id = prep["by_id"]
        self.tasks = data["tasks"]
        for t in self.tasks:
            # planned: what the simulated provider drew at the claim; runtime: what the rows show.
            t["planned"] = t["runtime"] if t["runtime"] is not None else scenario.runtime_per_unit * t["units"]
            if t["start"] is not None:
                t["runtime"] = (t["end"] - t["start"]) if t["end"] is not None else t["planned"]
            t["tenant"] = self.by_id[t["tenant_id"]].name if t["tenant_id"] in self.by_id else str(t["tenant_id"])
            t["group"] = self.by_id[t["tenant_id"]].group if t["tenant_id"] in self.by_id else "?"
            t["weight"] = self.by_id[t["tenant_id"]].weight if t["tenant_id"] in self.by_id else 1
        self.interventions = data["interventions"]
        self.drr = data["drr"]
        self.cfg = scenario.config
        self.lanes = sorted({t["lane"] for t in self.tasks}, key=lambda lane: scenario.lanes.index(lane) if lane in scenario.lanes else 99)
        # Provider accounts (resource key -> max_concurrency); each task's pool and the account it ran on.
        self.accounts = {account_key(p.name, a.account_id): a.max_concurrency for p in self.cfg.providers for a in p.accounts}
        routes: dict[tuple, tuple[str, ...]] = {}
        for t in self.tasks:
            ask = (t.get("model"), t.get("resolution"), t.get("duration_seconds"))
            if ask not in routes:
                routes[ask] = tuple(sorted(account_key(p.name, a.account_id) for p, a in candidates(self.cfg, *ask))) \
                    if ask[0] is not None else tuple(self.accounts)
            t["accounts"] = routes[ask]
            t["pool"] = " | ".join(routes[ask]) or "no account"
            t["ran_on"] = account_key(t["provider"], t["account"]) if t.get("provider") and t["start"] is not None else None
        self.pools = sorted({(t["lane"], t["pool"]) for t in self.tasks},
                            key=lambda lp: (self.lanes.index(lp[0]), lp[1]))
        self.pool_accounts = {t["pool"]: t["accounts"] for t in self.tasks}

    # -- waits -------------------------------------------------------------------------------------------
    def wait(self, t: dict) -> float | None:
        return None if t["start"] is None else t["start"] - t["enqueue"]

    def waited_so_far(self, t: dict) -> float:
        return (t["start"] if t["start"] is not None else self.end) - t["enqueue"]

    # -- saturation, delivery, fair shares ------------------------------------------------------------------
    @staticmethod
    def _in(t: dict, lane: str, pool: str | None) -> bool:
        return t["lane"] == lane and (pool is None or t["pool"] == pool)

    def _queue_gaps(self, lane: str, pool: str | None = None) -> list[tuple[float, float]]:
        """Intervals of positive length during which the lane (or its pool) had nothing queued."""
        deltas: dict[float, int] = defaultdict(int)
        for t in self.tasks:
            if not self._in(t, lane, pool):
                continue
            deltas[t["enqueue"]] += 1
            if t["start"] is not None:
                deltas[t["start"]] -= 1
        gaps, q = [], 0
        times = sorted(deltas)
        if not times or times[0] > 0:
            gaps.append((0.0, times[0] if times else self.end))
        for i, ts in enumerate(times):
            q += deltas[ts]
            nxt = times[i + 1] if i + 1 < len(times) else self.end
            if q == 0 and nxt > ts and ts < self.end:
                gaps.append((max(ts, 0.0), min(nxt, self.end)))
        return [g for g in gaps if g[1] > g[0]]

    def saturated_windows(self, lane: str, pool: str | None = None) -> list[tuple[float, float]]:
        W = self.sc.window_seconds
        gaps = self._queue_gaps(lane, pool)
        out = []
        for k in range(int(self.end // W)):
            a, b = k * W, (k + 1) * W
            if not any(_overlap(a, b, g0, g1) > 0 for g0, g1 in gaps):
                out.append((a, b))
        return out

    def fairness(self, lane: str, pool: str | None = None) -> dict:
        W = self.sc.window_seconds
        windows = self.saturated_windows(lane, pool)
        index = {int(a // W): (a, b) for a, b in windows}
        delivered: dict[int, dict] = defaultdict(lambda: defaultdict(float))
        potential: dict[int, dict] = defaultdict(lambda: defaultdict(float))
        for t in self.tasks:
            if not self._in(t, lane, pool):
                continue
            key = t["tenant_id"]
            start, rt, u = t["start"], t["runtime"], t["units"]
            stop = start + rt if start is not None else self.end
            first = max(0, int(max(t["enqueue"], 0.0) // W))
            last = int(min(stop, self.end) // W)
            for k in range(first, last + 1):
                if k not in index:
                    continue
                a, b = index[k]
                d = u * _overlap(start, start + rt, a, b) / rt if start is not None and rt > 0 else 0.0
                delivered[k][key] += d
                if start is not None and start < a:
                    potential[k][key] += d
                elif t["enqueue"] < b:
                    nominal = u * self.sc.runtime_per_unit
                    potential[k][key] += u * min(1.0, (b - max(a, t["enqueue"])) / nominal)
        total = short = 0.0
        per_window = []
        agg_d: dict = defaultdict(float)
        agg_f: dict = defaultdict(float)
        weights_of = {}
        for k in sorted(index):
            dk, pk = delivered[k], potential[k]
            tenants = set(dk) | set(pk)
            if not tenants:
                continue
            weights = {i: self.by_id[i].weight if i in self.by_id else 1 for i in tenants}
            weights_of.update(weights)
            C = sum(dk.values())
            fair = water_fill(C, weights, {i: max(pk.get(i, 0.0), dk.get(i, 0.0)) for i in tenants})
            s = sum(max(0.0, fair[i] - dk.get(i, 0.0)) for i in tenants)
            total += C
            short += s
            per_window.append(s / C if C > 0 else 0.0)
            for i in tenants:
                agg_d[i] += dk.get(i, 0.0)
                agg_f[i] += fair[i]
        # Completion rate over the saturated windows (tasks per second), for the whale's DRR ideal.
        sat_time = len(windows) * W
        completions = sum(1 for t in self.tasks if self._in(t, lane, pool) and t["end"] is not None
                          and int(t["end"] // W) in index and t["end"] < self.end)
        xs = [agg_d[i] / agg_f[i] for i in agg_f if agg_f[i] > EPS]
        # How many DRR rounds the saturated windows hold: a round gives each backlogged tenant up to
        # its quantum. Shares measured over less than a round or two say little about DRR.
        agg_p: dict = defaultdict(float)
        for k in index:
            for i, v in potential[k].items():
                agg_p[i] += v
        q = self.cfg.scheduler.base_quantum
        round_units = sum(min(q * (self.by_id[i].weight if i in self.by_id else 1), agg_p[i]) for i in agg_p)
        return {
            "window_seconds": W,
            "windows": int(self.end // W),
            "saturated_windows": len(windows),
            "delivered_units_in_saturated_windows": round(total, 2),
            "fairness_error": round(short / total, 4) if total > 0 else None,
            "fairness_error_worst_window": round(max(per_window), 4) if per_window else None,
            "jain_index": round(jain(xs), 4) if xs else None,
            "completion_rate_per_second": round(completions / sat_time, 4) if sat_time else None,
            "drr_rounds_in_saturated_windows": round(total / round_units, 2) if round_units > 0 else None,
            "_delivered": agg_d, "_fair": agg_f, "_total": total,
        }

    # -- utilisation and capacity invariants, in one sweep over every start and end -------------------------
    def sweep(self) -> dict:
        lanes_cfg = self.cfg.lanes
        slots_total = sum(a.max_concurrency for p in self.cfg.providers for a in p.accounts)
        ent = lanes_cfg[ENTERPRISE]
        events: dict[float, list] = defaultdict(list)
        for t in self.tasks:
            events[t["enqueue"]].append((0, t))
            if t["start"] is not None:
                events[t["start"]].append((1, t))
                stop = t["end"] if t["end"] is not None else t["start"] + t["runtime"]
                if stop <= self.end:
                    events[stop].append((2, t))
        queued: dict[str, int] = defaultdict(int)
        normal: dict[str, int] = defaultdict(int)
        borrowed: dict[str, int] = defaultdict(int)
        slots = 0
        acct_used: dict[str, int] = defaultdict(int)  # slots in use per provider account
        acct_queued: dict[str, int] = defaultdict(int)  # queued tasks each account could run
        acc = {"time_queued": 0.0, "u": 0.0, "slot_u": 0.0, "binding_slot_u": 0.0, "below_95_time": 0.0,
               "slots_bind": 0.0, "lane_binds": 0.0}
        lane_acc = {lane: {"time_queued": 0.0, "u": 0.0, "idle_unit_seconds": 0.0} for lane in self.lanes}
        acct_acc = {a: {"time_queued": 0.0, "u": 0.0, "idle_slot_seconds": 0.0} for a in self.accounts}
        max_slots = 0
        max_acct: dict[str, int] = defaultdict(int)
        max_normal: dict[str, int] = defaultdict(int)
        max_lent = max_ent_used = 0
        borrowed_while_reserved_waiting = 0
        borrowed_series: list[tuple[float, int]] = []
        ent_queue_series: list[tuple[float, int]] = []
        times = sorted(events)
        for i, ts in enumerate(times):
            borrowed_starts = []
            # Within one instant: releases first (a completion frees the slot the next claim takes),
            # then arrivals, then claims.
            for kind, t in sorted(events[ts], key=lambda e: (2, 0, 1).index(e[0])):
                lane = t["lane"]
                if kind == 0:
                    queued[lane] += 1
                    for a in t["accounts"]:
                        acct_queued[a] += 1
                elif kind == 1:
                    queued[lane] -= 1
                    for a in t["accounts"]:
                        acct_queued[a] -= 1
                    slots += t["slots"]
                    if t["ran_on"] is not None:
                        acct_used[t["ran_on"]] += t["slots"]
                        max_acct[t["ran_on"]] = max(max_acct[t["ran_on"]], acct_used[t["ran_on"]])
                    if t["mode"] == "BORROWED":
                        borrowed[lane] += t["units"]
                        borrowed_starts.append(t)
                    else:
                        normal[lane] += t["units"]
                else:
                    slots -= t["slots"]
                    if t["ran_on"] is not None:
                        acct_used[t["ran_on"]] -= t["slots"]
                    if t["mode"] == "BORROWED":
                        borrowed[lane] -= t["units"]
                    else:
                        normal[lane] -= t["units"]
            lent = sum(borrowed.values())
            ent_used = normal[ENTERPRISE] + lent
            if borrowed_starts and queued[ENTERPRISE] > 0:
                borrowed_while_reserved_waiting += len(borrowed_starts)
            max_slots = max(max_slots, slots)
            for lane, v in normal.items():
                max_normal[lane] = max(max_normal[lane], v)
            max_lent, max_ent_used = max(max_lent, lent), max(max_ent_used, ent_used)
            borrowed_series.append((ts, lent))
            ent_queue_series.append((ts, queued[ENTERPRISE]))
            nxt = times[i + 1] if i + 1 < len(times) else self.end
            lo, hi = max(ts, 0.0), min(nxt, self.end)
            dt = hi - lo
            if dt <= 0:
                continue
            qlanes = [lane for lane in self.lanes if queued[lane] > 0]
            if not qlanes:
                continue
            slot_u = slots / slots_total
            lane_us = []
            for lane in qlanes:
                cap = lanes_cfg[lane].capacity_units
                if lane == ENTERPRISE:
                    used, eff = ent_used, cap
                else:
                    extra = 0
                    if lane in BORROWERS and ent.borrowable_units > 0 and queued[ENTERPRISE] == 0:
                        extra = max(0, min(ent.borrowable_units - lent, ent.capacity_units - ent_used - ent.min_headroom_units))
                    used, eff = normal[lane] + borrowed[lane], cap + borrowed[lane] + extra
                lu = min(1.0, used / eff) if eff > 0 else 1.0
                lane_us.append(lu)
                la = lane_acc[lane]
                la["time_queued"] += dt
                la["u"] += lu * dt
                la["idle_unit_seconds"] += max(0, eff - used) * dt
            # The accounts that queued work could run on: their fill is the binding slots' utilisation.
            q_accts = [a for a in self.accounts if acct_queued[a] > 0]
            q_cap = sum(self.accounts[a] for a in q_accts)
            binding_slot_u = sum(min(acct_used[a], self.accounts[a]) for a in q_accts) / q_cap if q_cap else 0.0
            for a in q_accts:
                aa = acct_acc[a]
                aa["time_queued"] += dt
                aa["u"] += min(1.0, acct_used[a] / self.accounts[a]) * dt
                aa["idle_slot_seconds"] += max(0, self.accounts[a] - acct_used[a]) * dt
            lane_u = min(lane_us)
            u = max(binding_slot_u, lane_u)
            acc["time_queued"] += dt
            acc["u"] += u * dt
            acc["slot_u"] += slot_u * dt
            acc["binding_slot_u"] += binding_slot_u * dt
            acc["slots_bind" if binding_slot_u >= lane_u else "lane_binds"] += dt
            if u < 0.95:
                acc["below_95_time"] += dt
        tq = acc["time_queued"]
        inv = {
            "provider_slots_never_above_max_concurrency": {
                "ok": max_slots <= slots_total and all(max_acct[a] <= cap for a, cap in self.accounts.items()),
                "max_slots_in_use": max_slots, "max_concurrency": slots_total,
                "by_account": {a: {"max_slots_in_use": max_acct[a], "max_concurrency": cap} for a, cap in self.accounts.items()}},
            "lane_units_never_above_capacity": {"ok": all(max_normal[lane] <= lanes_cfg[lane].capacity_units for lane in max_normal)
                                                and max_ent_used <= ent.capacity_units,
                                                "max_normal_units": dict(max_normal), "max_enterprise_units_incl_lent": max_ent_used},
            "lent_units_never_above_borrowable": {"ok": max_lent <= ent.borrowable_units, "max_lent": max_lent,
                                                  "borrowable_units": ent.borrowable_units},
            "no_new_borrowing_while_reserved_work_waits": {"ok": borrowed_while_reserved_waiting == 0,
                                                           "borrowed_claims_while_enterprise_queued": borrowed_while_reserved_waiting},
        }
        return {
            "utilisation": {
                "when_work_queued": round(acc["u"] / tq, 4) if tq else None,
                "provider_slots_when_work_queued": round(acc["slot_u"] / tq, 4) if tq else None,
                "binding_provider_slots_when_work_queued": round(acc["binding_slot_u"] / tq, 4) if tq else None,
                "seconds_provider_slots_fuller_than_lane": round(acc["slots_bind"], 1),
                "seconds_lane_fuller_than_provider_slots": round(acc["lane_binds"], 1),
                "seconds_with_work_queued": round(tq, 1),
                "seconds_below_95_percent_while_queued": round(acc["below_95_time"], 1),
                "by_lane": {lane: {"when_lane_queued": round(v["u"] / v["time_queued"], 4) if v["time_queued"] else None,
                                   "seconds_lane_queued": round(v["time_queued"], 1),
                                   "idle_unit_seconds_while_queued": round(v["idle_unit_seconds"], 1)}
                            for lane, v in lane_acc.items()},
                "by_account": {a: {"max_concurrency": self.accounts[a],
                                   "when_account_queued": round(v["u"] / v["time_queued"], 4) if v["time_queued"] else None,
                                   "seconds_account_queued": round(v["time_queued"], 1),
                                   "idle_slot_seconds_while_queued": round(v["idle_slot_seconds"], 1)}
                               for a, v in acct_acc.items()},
                "definition": "utilisation of the binding capacity: time-average, over the moments some lane has queued "
                              "work, of max(slots in use / max_concurrency over the provider accounts that queued work "
                              "could run on, the lowest lane fill among lanes with queued work); a lane's fill counts the "
                              "enterprise units it may borrow at that moment. provider_slots_when_work_queued is over all "
                              "accounts, binding_provider_slots_when_work_queued over those with work waiting",
            },
            "invariants": inv,
            "_borrowed_series": borrowed_series,
            "_ent_queue_series": ent_queue_series,
        }

    # -- interventions and the starvation check -------------------------------------------------------
    def starvation(self) -> dict:
        by_task = defaultdict(set)
        for i in self.interventions:
            if i["task_id"] is not None:
                by_task[i["task_id"]].add(i["kind"])
        past = missing = missing_grace = 0
        worst = []
        for t in self.tasks:
            limit = self.cfg.lanes[t["lane"]].max_wait_seconds
            w = self.waited_so_far(t)
            if w > limit:
                past += 1
                if "STARVATION" not in by_task[t["task_id"]]:
                    missing += 1
                    worst.append(round(w, 1))
                    if w > limit + self.sc.maintenance_seconds:
                        missing_grace += 1
        return {"tasks_past_lane_max_wait": past, "without_starvation_intervention": missing,
                "without_intervention_beyond_one_detector_period": missing_grace,
                "detector_period_seconds": self.sc.maintenance_seconds,
                "lane_max_wait_seconds": {lane: self.cfg.lanes[lane].max_wait_seconds for lane in self.lanes},
                "ok": missing_grace == 0,
                "longest_waits_without_intervention": sorted(worst, reverse=True)[:5]}

    # -- the report of one run ---------------------------------------------------------------------------
    def _share_doc(self, f: dict, lane: str, pool: str | None, kinds: dict) -> dict:
        """The figures of one fairness() result, with a row per tenant (or per group, when many)."""
        rows: dict = {}
        tenants = defaultdict(list)
        for t in self.tasks:
            if self._in(t, lane, pool):
                tenants[t["tenant_id"]].append(t)
        for tid, ts in tenants.items():
            d, fs = f["_delivered"].get(tid, 0.0), f["_fair"].get(tid, 0.0)
            waits = [w for w in (self.wait(t) for t in ts) if w is not None]
            rows[tid] = {
                "tenant": ts[0]["tenant"], "group": ts[0]["group"], "weight": ts[0]["weight"],
                "tasks": len(ts), "tasks_started": sum(1 for t in ts if t["start"] is not None),
                "units_started": sum(t["units"] for t in ts if t["start"] is not None),
                "delivered_units_saturated": round(d, 2), "fair_units_saturated": round(fs, 2),
                "share": round(d / f["_total"], 4) if f["_total"] else None,
                "fair_share": round(fs / f["_total"], 4) if f["_total"] else None,
                "delivered_over_fair": round(d / fs, 4) if fs > EPS else None,
                "wait_seconds": wait_stats(waits),
                "still_queued": sum(1 for t in ts if t["start"] is None),
                "oldest_still_queued_waited": round(max((self.end - t["enqueue"] for t in ts if t["start"] is None), default=0.0), 1),
                "borrowed_units": sum(t["units"] for t in ts if t["mode"] == "BORROWED"),
                "borrowed_tasks": sum(1 for t in ts if t["mode"] == "BORROWED"),
                "interventions": dict(kinds.get((lane, tid), {})) if pool is None else {},
                "_waits": waits,
            }
        doc = {k: v for k, v in f.items() if not k.startswith("_")}
        doc["wait_seconds"] = wait_stats([w for r in rows.values() for w in r["_waits"]])
        if pool is None:
            doc["interventions"] = {k: sum(r["interventions"].get(k, 0) for r in rows.values())
                                    for k in sorted({k for r in rows.values() for k in r["interventions"]})}
            doc["borrowed_units"] = sum(r["borrowed_units"] for r in rows.values())
        if len(rows) <= TENANT_LIST_LIMIT:
            doc["tenants"] = {r["tenant"]: {k: v for k, v in r.items() if not k.startswith("_") and k != "tenant"}
                              for r in sorted(rows.values(), key=lambda r: r["tenant"])}
        else:
            doc["tenants_by_group"] = self._groups(rows)
        return doc

    def analyse(self) -> dict:
        sweep = self.sweep()
        kinds = defaultdict(lambda: defaultdict(int))
        for i in self.interventions:
            kinds[(i["lane"], i["tenant_id"])][i["kind"]] += 1
        lanes = {}
        fair_by_lane = {}
        for lane in self.lanes:
            f = self.fairness(lane)
            fair_by_lane[lane] = f
            lanes[lane] = self._share_doc(f, lane, None, kinds)
        # Per (lane, pool of provider accounts): the shares where the accounts' slots bind. A lane
        # with one pool has the lane's own figures.
        pools: dict = defaultdict(dict)
        for lane, pool in self.pools:
            if sum(1 for ln, _ in self.pools if ln == lane) == 1:
                doc = {k: v for k, v in lanes[lane].items() if k not in ("interventions", "borrowed_units", "tenants",
                                                                          "tenants_by_group")}
                doc["same_as_lane"] = True
            else:
                doc = self._share_doc(self.fairness(lane, pool), lane, pool, kinds)
            doc["accounts"] = {a: self.accounts.get(a) for a in self.pool_accounts[pool]}
            pools[lane][pool] = doc
        out = {
            "end_seconds": round(self.end, 3),
            "tasks": {"total": len(self.tasks), "started": sum(1 for t in self.tasks if t["start"] is not None),
                      "succeeded": sum(1 for t in self.tasks if t["state"] == "SUCCEEDED"),
                      "queued_at_end": sum(1 for t in self.tasks if t["state"] == "QUEUED")},
            "lanes": lanes,
            "pools": dict(pools),
            "utilisation": sweep["utilisation"],
            "interventions": self._intervention_totals(),
            "starvation_check": self.starvation(),
            "drr_state": {"tenants": len(self.drr), "min_deficit": min((r["deficit"] for r in self.drr), default=None),
                          "max_deficit": max((r["deficit"] for r in self.drr), default=None)},
            "sweep_invariants": sweep["invariants"],
        }
        focus = getattr(self, f"_focus_{self.sc.focus.get('kind', self.sc.name).replace('-', '_')}", None)
        if focus:
            out["focus"] = focus(fair_by_lane, sweep)
        return out

    def _intervention_totals(self) -> dict:
        out: dict = defaultdict(int)
        for i in self.interventions:
            out[i["kind"]] += 1
        return dict(out)

    def _groups(self, rows: dict) -> dict:
        groups = defaultdict(list)
        for r in rows.values():
            groups[r["group"]].append(r)
        out = {}
        for g, rs in sorted(groups.items()):
            ratios = [r["delivered_over_fair"] for r in rs if r["delivered_over_fair"] is not None]
            out[g] = {
                "tenants": len(rs), "tasks": sum(r["tasks"] for r in rs), "tasks_started": sum(r["tasks_started"] for r in rs),
                "delivered_units_saturated": round(sum(r["delivered_units_saturated"] for r in rs), 2),
                "fair_units_saturated": round(sum(r["fair_units_saturated"] for r in rs), 2),
                "delivered_over_fair_min": round(min(ratios), 4) if ratios else None,
                "delivered_over_fair_max": round(max(ratios), 4) if ratios else None,
                "wait_seconds": wait_stats([w for r in rs for w in r["_waits"]]),
                "still_queued": sum(r["still_queued"] for r in rs),
                "interventions": {k: sum(r["interventions"].get(k, 0) for r in rs)
                                  for k in sorted({k for r in rs for k in r["interventions"]})},
            }
            if len(rs) <= TENANT_LIST_LIMIT:
                out[g]["tenants_detail"] = {r["tenant"]: {k: v for k, v in r.items() if not k.startswith("_") and k != "tenant"}
                                            for r in sorted(rs, key=lambda r: r["tenant"])}
        return out

    # -- scenario-specific figures ---------------------------------------------------------------------------
    def _queued_counter(self, lane: str, pool: str | None = None):
        """count(tenant, t): that tenant's tasks queued in `lane` (and pool) at time t (enqueued <= t < started)."""
        enq, sta = defaultdict(list), defaultdict(list)
        for t in self.tasks:
            if self._in(t, lane, pool):
                enq[t["tenant_id"]].append(t["enqueue"])
                sta[t["tenant_id"]].append(t["start"] if t["start"] is not None else math.inf)
        for d in (enq, sta):
            for v in d.values():
                v.sort()

        def count(tid, ts: float) -> int:
            return bisect.bisect_right(enq[tid], ts) - bisect.bisect_right(sta[tid], ts)

        return list(enq), count

    def _focus_whale_vs_small(self, fair_by_lane: dict, sweep: dict) -> dict:
        lane = self.sc.focus["lane"]
        group = self.sc.focus["small_group"]
        # The slots that count are those the small tenants' work can run on: the lane's, or, where
        # it runs on one pool of provider accounts, that pool's (the binding capacity).
        small_pools = {t["pool"] for t in self.tasks if t["lane"] == lane and t["group"] == group}
        pool = next(iter(small_pools)) if len(small_pools) == 1 and len({p for ln, p in self.pools if ln == lane}) > 1 else None
        # The completion rate while the lane had work queued (so short runs need no whole window).
        gaps = self._queue_gaps(lane, pool)
        busy = self.end - sum(g1 - g0 for g0, g1 in gaps)
        done = sum(1 for t in self.tasks if self._in(t, lane, pool) and t["end"] is not None
                   and not any(g0 <= t["end"] < g1 for g0, g1 in gaps))
        rate = round(done / busy, 4) if busy > 0 else None
        tenants, count = self._queued_counter(lane, pool)
        # Every slot release the run scheduled, including those of tasks still running at its end.
        ends = sorted(t["start"] + t["planned"] for t in self.tasks if self._in(t, lane, pool) and t["start"] is not None)

        def slots_freed_within(t0: float, n: int) -> float | None:
            """Seconds after t0 until n slots have actually freed (the completions that happened)."""
            i = bisect.bisect_right(ends, t0) + n - 1
            return ends[i] - t0 if i < len(ends) else None

        out = {}
        for tid in sorted((t for t in tenants if self.by_id[t].group == group), key=lambda t: self.by_id[t].name):
            ts = [t for t in self.tasks if t["tenant_id"] == tid and self._in(t, lane, pool)]
            backlogged = []
            for t in ts:
                others = sum(1 for o in tenants if o != tid and count(o, t["enqueue"]) > 0)
                backlogged.append(others + 1)
            waits = [self.wait(t) for t in ts if t["start"] is not None]
            p99 = percentile(waits, 99)
            b = max(backlogged) if backlogged else 0
            ideal = b / rate if rate else None
            # The realised-slot ideal of a task: as many slots freeing as there were backlogged
            # tenants (its own included), counted from when it would have reached the head of its
            # tenant's queue had each of its tenant's earlier tasks started at its own ideal. Counted
            # from the enqueue alone (the ideal before), a task behind its own tenant's earlier tasks
            # was owed a slot in the first round as if they were not there: the whale-provider-bound
            # small tenants' Poisson arrivals come in bursts (one submitted four tasks in nine
            # seconds), and a perfect per-slot round robin scored 1.9 on that count. Chained on ideal
            # starts, not actual ones, a scheduler's delay of one task is not credited to the next.
            realised, ahead_max, ideal_start = [], 0, -math.inf
            for t in sorted(ts, key=lambda t: (t["enqueue"], t["key"])):
                ahead_max = max(ahead_max, sum(1 for o in ts if o is not t and o["enqueue"] <= t["enqueue"]
                                               and (o["start"] is None or o["start"] > t["enqueue"])))
                h = max(t["enqueue"], ideal_start)
                x = slots_freed_within(h, sum(1 for o in tenants if o != tid and count(o, h) > 0) + 1)
                if x is None:
                    break
                ideal_start = h + x
                realised.append(ideal_start - t["enqueue"])
            p99_realised = percentile(realised, 99)
            n_slot = [x for x in (slots_freed_within(t["enqueue"], n) for t, n in zip(ts, backlogged)) if x is not None]
            p99_n_slot = percentile(n_slot, 99)
            out[self.by_id[tid].name] = {
                "tasks": len(ts), "started": len(waits), "p99_wait": round(p99, 2) if p99 is not None else None,
                "max_wait": round(max(waits), 2) if waits else None,
                "backlogged_tenants_max": b, "backlogged_tenants_mean": round(sum(backlogged) / len(backlogged), 2) if backlogged else None,
                "drr_ideal_seconds": round(ideal, 2) if ideal else None,
                "p99_over_ideal": round(p99 / ideal, 3) if ideal and p99 is not None else None,
                "p99_realised_slot_ideal": round(p99_realised, 2) if p99_realised is not None else None,
                "p99_over_realised_slot_ideal": round(p99 / p99_realised, 3) if p99_realised and p99 is not None else None,
                "own_tasks_ahead_max": ahead_max,  # the most of its own tasks queued ahead of one of its tasks
                # The count from the enqueue alone (the realised-slot ideal before), for comparison.
                "p99_over_n_slot_from_enqueue": round(p99 / p99_n_slot, 3) if p99_n_slot and p99 is not None else None,
                # What a perfect per-slot round robin would score on the rate-based ideal: the spread of
                # completion times alone, with no scheduler in it.
                "oracle_p99_over_ideal": round(p99_realised / ideal, 3) if ideal and p99_realised is not None else None,
                "unstarted_waited_so_far": [round(self.end - t["enqueue"], 1) for t in ts if t["start"] is None],
            }
        ratios = [v["p99_over_ideal"] for v in out.values() if v["p99_over_ideal"] is not None]
        realised = [v["p99_over_realised_slot_ideal"] for v in out.values() if v["p99_over_realised_slot_ideal"] is not None]
        unstarted = sum(len(v["unstarted_waited_so_far"]) for v in out.values())
        return {"completion_rate_per_second": rate, "lane": lane, "pool": pool or "the lane's",
                "ideal_definition": "issue 4: backlogged tenants at the task's enqueue (the most over the tenant's tasks, "
                                    "its own included) / the measured completion rate of the slots its work runs on "
                                    "(the lane's, or its one pool of provider accounts') while work was queued",
                "realised_slot_ideal_definition": "per task: the time until as many slots (of the lane, or of the pool its "
                                                  "work runs on) actually freed as there were backlogged tenants (its own "
                                                  "included), counted from its enqueue or, behind its own tenant's earlier "
                                                  "tasks, from the ideal start of the last of them (per-slot round robin "
                                                  "on the real completion sequence); p99 over the tenant's tasks",
                "small_tenants": out, "worst_p99_over_ideal": max(ratios) if ratios else None,
                "worst_p99_over_realised_slot_ideal": max(realised) if realised else None,
                "worst_p99_over_n_slot_from_enqueue": max((v["p99_over_n_slot_from_enqueue"] for v in out.values()
                                                           if v["p99_over_n_slot_from_enqueue"] is not None), default=None),
                "worst_oracle_p99_over_ideal": max((v["oracle_p99_over_ideal"] for v in out.values()
                                                    if v["oracle_p99_over_ideal"] is not None), default=None),
                "all_small_within_1_5x": bool(ratios) and unstarted == 0 and max(ratios) <= 1.5,
                "all_small_within_1_5x_realised": bool(realised) and unstarted == 0 and max(realised) <= 1.5}

    def _focus_enterprise_borrowing(self, fair_by_lane: dict, sweep: dict) -> dict:
        R = self.sc.focus["return_at"]
        ent_q = sweep["_ent_queue_series"]
        drained = next((ts for ts, q in ent_q if ts > R and q == 0), None)
        phases = [("before_return", 0.0, R), ("reserved_backlog", R, drained or self.end), ("after_backlog_drained", drained or self.end, self.end)]
        series = sweep["_borrowed_series"]
        out_phases = {}
        for name, a, b in phases:
            claims = [t for t in self.tasks if t["mode"] == "BORROWED" and t["start"] is not None and a <= t["start"] < b]
            area = 0.0
            for i, (ts, lent) in enumerate(series):
                nxt = series[i + 1][0] if i + 1 < len(series) else self.end
                area += lent * _overlap(ts, nxt, a, b)
            out_phases[name] = {"from": round(a, 1), "to": round(b, 1), "borrowed_claims": len(claims),
                                "borrowed_units_claimed": sum(t["units"] for t in claims),
                                "mean_lent_units_running": round(area / (b - a), 2) if b > a else None}
        running_at_return = [t for t in self.tasks if t["mode"] == "BORROWED" and t["start"] is not None
                             and t["start"] < R < t["start"] + t["planned"]]
        finished_normally = sum(1 for t in running_at_return if t["state"] == "SUCCEEDED"
                                and t["end"] is not None and abs((t["end"] - t["start"]) - t["planned"]) < 0.002)
        ent = [t for t in self.tasks if t["lane"] == ENTERPRISE]
        ent_waits = [self.wait(t) for t in ent if t["start"] is not None]
        burst = [self.wait(t) for t in ent if t["start"] is not None and abs(t["enqueue"] - R) < 1e-6]
        paid = self.sc.focus["lane"]
        thr = {}
        for name, a, b in phases:
            units = sum(t["units"] for t in self.tasks if t["lane"] == paid and t["start"] is not None and a <= t["start"] < b)
            thr[name] = round(units / (b - a), 3) if b > a else None
        return {
            "return_at": R, "reserved_backlog_drained_at": drained,
            "phases": out_phases,
            "borrowed_running_at_return": len(running_at_return),
            "borrowed_running_at_return_finished_normally": finished_normally,
            "last_borrowed_task_running_at_return_ended": round(max((t["start"] + t["runtime"] for t in running_at_return), default=R), 2),
            "enterprise_wait_seconds": wait_stats(ent_waits),
            "enterprise_burst_wait_seconds": wait_stats(burst),
            "paid_shared_units_claimed_per_second": thr,
            "new_borrowing_stopped_while_reserved_waiting": sweep["invariants"]["no_new_borrowing_while_reserved_work_waits"]["ok"],
            "running_borrowed_work_not_preempted": finished_normally == len(running_at_return),
        }

    def _focus_big_task_starvation(self, fair_by_lane: dict, sweep: dict) -> dict:
        lane = self.sc.focus["lane"]
        cap = self.cfg.lanes[lane].capacity_units
        by_task = defaultdict(list)
        for i in self.interventions:
            by_task[i["task_id"]].append({"kind": i["kind"], **(i["detail"] or {})})
        bigs = {}
        for key in self.sc.focus["big_keys"]:
            t = next((t for t in self.tasks if t["key"] == key), None)
            if t is None:
                continue
            a, b = t["enqueue"], t["start"] if t["start"] is not None else self.end
            others = [o for o in self.tasks if o["lane"] == lane and o["tenant_id"] != t["tenant_id"]]
            during = sum(o["units"] for o in others if o["start"] is not None and a <= o["start"] < b)
            before = sum(o["units"] for o in others if o["start"] is not None and max(0.0, a - 300) <= o["start"] < a)
            own_small = [o for o in self.tasks if o["tenant_id"] == t["tenant_id"]
                         and o["key"].startswith(self.sc.focus["small_prefix"][key])]
            bigs[key] = {
                "units": t["units"], "enqueued_at": round(a, 1), "wait": round(self.wait(t), 2) if t["start"] is not None else None,
                "waited_so_far_if_unstarted": None if t["start"] is not None else round(self.end - a, 1),
                "skip_count": t["skips"], "interventions": by_task.get(t["task_id"], []),
                "others_units_claimed_per_second_during_wait": round(during / (b - a), 3) if b > a else None,
                "others_units_claimed_per_second_300s_before": round(before / min(300.0, a), 3) if a > 0 else None,
                "lane_capacity_units_per_second": round(cap / self.sc.runtime_per_unit, 3),
                "own_small_tasks_behind_it_wait": wait_stats([self.wait(o) for o in own_small if o["start"] is not None]),
            }
        return {"big_tasks": bigs,
                "not_starved": all(v["wait"] is not None for v in bigs.values()),
                "others_keep_flowing": all((v["others_units_claimed_per_second_during_wait"] or 0) > 0 for v in bigs.values())}

    def _focus_many_tenants(self, fair_by_lane: dict, sweep: dict) -> dict:
        lane = self.sc.focus["lane"]
        q = self.cfg.scheduler.base_quantum
        bulk = [t for t in self.tasks if t["group"] == self.sc.focus["bulk_group"]]
        heavy = defaultdict(list)
        for t in self.tasks:
            if t["group"] == "heavy":
                heavy[t["tenant"]].append(t)
        st = self.stats
        served = {t["tenant_id"] for t in bulk if t["start"] is not None}
        heavy_doc = {}
        for name, ts in sorted(heavy.items()):
            w = ts[0]["weight"]
            heavy_doc[name] = {"weight": w, "units_started": sum(t["units"] for t in ts if t["start"] is not None),
                               "quantum_per_turn": q * w,
                               "initial_burst_credit": 2 * q * w}
        return {
            "active_tenants_at_start": len({t["tenant_id"] for t in self.tasks if t["enqueue"] <= 0}),
            "bulk_tenants_served": len(served),
            "bulk_tenants_waiting_at_end": len(bulk) - len(served),
            "bulk_wait_seconds": wait_stats([self.wait(t) for t in bulk if t["start"] is not None]),
            "bulk_oldest_waiting_at_end": round(max((self.end - t["enqueue"] for t in bulk if t["start"] is None), default=0.0), 1),
            "heavy_tenants": heavy_doc,
            "ms_per_claim_including_picks": round(1000 * st.dispatch_wall_seconds / st.claims, 3) if st.claims else None,
            "visits_per_claim": round(st.visits / st.claims, 3) if st.claims and st.visits else None,
            "lane": lane,
        }

    def _focus_peak_backlog(self, fair_by_lane: dict, sweep: dict) -> dict:
        """Ch. 18.17's backlog build and drain, measured from the task rows, beside Little's law
        (scenarios.littles_law, computed when the scenario was built). Queued = enqueued and not yet
        started; in flight = started and not yet finished, which is also the slots in use (every task
        holds one)."""
        fo = self.sc.focus
        pred, tol = fo["prediction"], fo["tolerance"]
        a, b, steady_from = fo["peak_start"], fo["peak_end"], fo["steady_from"]
        slots = sum(self.accounts.values())
        deltas: dict[float, list[int]] = defaultdict(lambda: [0, 0])  # time -> [queued delta, in-flight delta]
        for t in self.tasks:
            deltas[t["enqueue"]][0] += 1
            if t["start"] is not None:
                deltas[t["start"]][0] -= 1
                deltas[t["start"]][1] += 1
                if t["end"] is not None:
                    deltas[t["end"]][1] -= 1
        # The levels, piecewise constant: steps[i] = (ts, queued, in_flight) holds on [ts, next ts).
        steps, q, r = [(0.0, 0, 0)], 0, 0
        for ts in sorted(deltas):
            q, r = q + deltas[ts][0], r + deltas[ts][1]
            if ts >= 0:
                steps.append((ts, q, r))
        times = [s[0] for s in steps]
        ends = times[1:] + [self.end]

        def level(ts: float) -> tuple[int, int]:
            s = steps[max(0, bisect.bisect_right(times, ts) - 1)]
            return s[1], s[2]

        def held(x: float, y: float):
            """(level, seconds) of each step overlapping [x, y) for a positive time."""
            return [(s, _overlap(s[0], e, x, y)) for s, e in zip(steps, ends) if _overlap(s[0], e, x, y) > 0]

        def mean_in_flight(x: float, y: float) -> float | None:
            parts = held(x, y)
            return sum(s[2] * d for s, d in parts) / (y - x) if parts and y > x else None

        # A momentary level (enqueue and claim in one instant) never counts: only levels held a while.
        whole = held(0.0, self.end)
        peak_level, peak_at = max(((s[1], s[0]) for s, _ in whole), key=lambda v: (v[0], -v[1]), default=(0, None))
        steady_level = max((s[1] for s, _ in held(steady_from, a)), default=0)
        q_end, _ = level(b)
        drained_at = b if q_end <= steady_level else next(
            (s[0] for s in steps if s[0] > b and s[1] <= steady_level and s[0] < self.end), None)
        backlog_from = next((s[0] for s in steps if s[0] >= a and s[1] > steady_level), None)
        m_peak = mean_in_flight(a, min(b, self.end))
        m_backlogged = mean_in_flight(backlog_from, drained_at) if backlog_from is not None and drained_at else None
        m_steady = mean_in_flight(steady_from, a)
        rnd = lambda x, n=4: None if x is None else round(x, n)  # noqa: E731
        drain = None if drained_at is None else drained_at - b
        measured = {
            "peak_backlog_tasks": peak_level, "peak_backlog_at": rnd(peak_at, 1), "backlog_at_peak_end": q_end,
            "steady_level": steady_level, "drained_at": rnd(drained_at, 1), "drain_seconds": rnd(drain, 1),
            "steady_in_flight_mean": rnd(m_steady, 1), "in_flight_max": max((s[2] for s in steps), default=0),
            "slot_utilisation_steady": rnd(m_steady / slots if m_steady is not None else None),
            "slot_utilisation_during_peak": rnd(m_peak / slots if m_peak is not None else None),
            "slot_utilisation_while_backlogged": rnd(m_backlogged / slots if m_backlogged is not None else None),
            "peak_backlog_tasks_x_scale": peak_level * fo["scale"],
        }
        step = fo["sample_seconds"]
        samples = [k * step for k in range(int(self.end // step) + 1)]
        levels = [level(ts) for ts in samples]
        return {
            "scale": fo["scale"], "provider_slots": slots,
            "phases": {"steady_from": steady_from, "peak_start": a, "peak_end": b, "end": round(self.end, 1)},
            "prediction": pred, "prediction_full_scale": fo["prediction_full_scale"],
            "measured": measured,
            "check": checks.against_prediction({"backlog_tasks": peak_level, "drain_seconds": rnd(drain, 1)},
                                               {k: pred[k] for k in ("backlog_tasks", "drain_seconds")}, tol),
            "backlog_series": {"sample_seconds": step, "t": samples, "queued": [v[0] for v in levels],
                               "in_flight": [v[1] for v in levels]},
            "definitions": {
                "peak_backlog_tasks": "the most tasks queued (admitted, not yet claimed) at once, held for a positive time",
                "steady_level": "the most queued during the steady phase before the peak, after the warm-up transient "
                                "(from the longest runtime a task can draw)",
                "drain_seconds": "from the end of the peak to the first moment the queue is back at the steady level",
                "slot_utilisation_during_peak": "mean slots in use / provider slots over the peak (starts below 1: the "
                                                "headroom of L = lambda x W in flight fills first)",
                "slot_utilisation_while_backlogged": "the same from the first queued task of the peak until drained",
            },
        }


def analyse(scenario: Scenario, prep: dict, data: dict, stats) -> dict:
    return Run(scenario, prep, data, stats).analyse()


# -- the scenario report: both runs, and the targets ----------------------------------------------------------

def _target(name: str, target: str, values: dict, met: bool | None) -> dict:
    return {"name": name, "target": target, **values, "met": met}


def report(scenario: Scenario, prep: dict, runs: dict) -> dict:
    targets = []
    lane = scenario.focus.get("lane")
    kind = scenario.focus.get("kind", scenario.name)
    drr, fifo = runs.get("drr"), runs.get("fifo")

    def fe(r):
        return r["lanes"][lane]["fairness_error"] if r and lane in r["lanes"] else None

    if kind in ("weighted-4-2-1", "mixed-cost", "provider-bound-4-2-1"):
        v = fe(drr)
        targets.append(_target("fairness_error", "<= 0.03 (DRR, saturated windows)", {"drr": v, "fifo": fe(fifo)},
                               v is not None and v <= 0.03 if drr else None))
    if scenario.focus.get("per_pool"):
        def pool_fe(r):
            return {pool: d["fairness_error"] for pool, d in r["pools"].get(lane, {}).items()} if r else None

        v = pool_fe(drr)
        targets.append(_target("fairness_error_per_pool", "<= 0.03 in every provider-account pool (DRR, saturated windows)",
                               {"drr": v, "fifo": pool_fe(fifo)},
                               all(x is not None and x <= 0.03 for x in v.values()) if drr else None))
    if kind == "whale-vs-small":
        f = lambda r, k: r["focus"][k] if r else None  # noqa: E731
        # A figure, not a target (met is None): the ideal that counts is the realised-slot one below
        # (the planners' answer). On this rate-based reading a perfect per-slot round robin on the
        # same arrivals (the oracle) scores about 2.08, so no scheduler could meet 1.5 on it.
        targets.append(_target("small_tenant_p99_wait_over_drr_ideal",
                               "figure only (the target is the realised-slot ideal): ideal = backlogged tenants / measured "
                               "completion rate; FIFO for contrast; oracle = a perfect per-slot round robin on the run's real "
                               "completions, which this reading holds to the same figure",
                               {"drr": f(drr, "worst_p99_over_ideal"), "fifo": f(fifo, "worst_p99_over_ideal"),
                                "oracle": f(drr, "worst_oracle_p99_over_ideal")},
                               None))
        targets.append(_target("small_tenant_p99_wait_over_realised_slot_ideal",
                               "<= 1.5 for every small tenant (DRR), ideal = time until that many slots actually freed; "
                               "FIFO for contrast",
                               {"drr": f(drr, "worst_p99_over_realised_slot_ideal"),
                                "fifo": f(fifo, "worst_p99_over_realised_slot_ideal")},
                               drr["focus"]["all_small_within_1_5x_realised"] if drr else None))
    if scenario.name == "enterprise-borrowing":
        for pol, r in runs.items():
            fo = r["focus"]
            targets.append(_target(f"no_new_borrowing_while_reserved_demand_waits[{pol}]",
                                   "no BORROWED claim while ENTERPRISE_RESERVED work is queued",
                                   {"borrowed_claims_during_reserved_backlog": fo["phases"]["reserved_backlog"]["borrowed_claims"]},
                                   fo["new_borrowing_stopped_while_reserved_waiting"]))
            targets.append(_target(f"running_borrowed_work_finishes_unpreempted[{pol}]",
                                   "every borrowed task running at the return finishes its full run",
                                   {"running_at_return": fo["borrowed_running_at_return"],
                                    "finished_normally": fo["borrowed_running_at_return_finished_normally"]},
                                   fo["running_borrowed_work_not_preempted"]))
    if scenario.name == "big-task-starvation":
        for pol, r in runs.items():
            fo = r["focus"]
            waits = {k: v["wait"] if v["wait"] is not None else f">{v['waited_so_far_if_unstarted']}" for k, v in fo["big_tasks"].items()}
            targets.append(_target(f"big_head_task_not_starved[{pol}]", "every big task starts within the run",
                                   {"waits": waits}, fo["not_starved"]))
            targets.append(_target(f"others_keep_flowing_while_it_waits[{pol}]",
                                   "other tenants keep claiming while the big task waits",
                                   {"others_units_per_second": {k: v["others_units_claimed_per_second_during_wait"]
                                                                for k, v in fo["big_tasks"].items()}},
                                   fo["others_keep_flowing"]))
    if kind == "peak-backlog":
        for pol, r in runs.items():
            c = r["focus"]["check"]
            targets.append(_target(f"backlog_and_drain_match_littles_law[{pol}]",
                                   f"peak backlog and drain time within {c['tolerance']:.0%} of ch. 18.17's prediction",
                                   {k: {f: v[f] for f in ("measured", "predicted", "error")} for k, v in c["figures"].items()},
                                   c["ok"]))
    for pol, r in runs.items():
        u = r["utilisation"]["when_work_queued"]
        targets.append(_target(f"utilisation_when_work_queued[{pol}]", ">= 0.95 of the binding capacity", {"value": u},
                               u is not None and u >= 0.95))
        targets.append(_target(f"no_wait_past_lane_max_without_intervention[{pol}]",
                               "every task waiting past its lane's max_wait has a STARVATION intervention (within one detector period)",
                               {"value": r["starvation_check"]["without_intervention_beyond_one_detector_period"]},
                               r["starvation_check"]["ok"]))
        targets.append(_target(f"invariants[{pol}]", "all hold", {"failed": [k for k, v in r["invariants"].items() if not v["ok"]]},
                               r["invariants_ok"]))
    return {
        "scenario": scenario.name,
        "description": scenario.description,
        "parameters": scenario.parameters,
        "notes": scenario.notes,
        "simulation": {
            "clock": "ManualClock (SimClock) moved only by the event loop; times are simulated platform seconds",
            "time_scale": scenario.config.time_scale,
            "provider": f"simulated in-process: a task runs units x {scenario.runtime_per_unit:g} s x U(1-{scenario.jitter:g}, "
                        f"1+{scenario.jitter:g}) ({'an even spread over the arrivals' if scenario.runtime_draws else 'hash of its key'}), "
                        "then succeeds",
            "maintenance_seconds": scenario.maintenance_seconds,
            "scheduler": scenario.config.scheduler.model_dump(),
            "lanes": {lane: scenario.config.lanes[lane].model_dump() for lane in scenario.lanes},
            "provider_slots": sum(a.max_concurrency for p in scenario.config.providers for a in p.accounts),
            "provider_accounts": {account_key(p.name, a.account_id): {"max_concurrency": a.max_concurrency, "models": p.models}
                                  for p in scenario.config.providers for a in p.accounts},
            "fresh_scheduler_per_tick": scenario.fresh_scheduler_per_tick,
        },
        "prefill": prep["prefill"],
        "targets": targets,
        "runs": runs,
    }
