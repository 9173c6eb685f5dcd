-- 0100: a DRR turn that capacity cut short is a fact in PostgreSQL, not one process's memory.
-- The deployed tick builds a new Scheduler per invocation, and several replicas may tick: a turn
-- held in memory was lost at every tick, so each freed slot went to the next tenant of the ring and
-- weights stopped mattering wherever a provider account, not the lane, was the binding limit.
--
-- paused_on names the resource key (a provider account, a model cap, the lane) and paused_kind how
-- the tenant stands towards it:
--   TURN     its turn began and waits for room: it keeps its deficit and resumes with no new quantum;
--   WAITING  its turn could not begin, the key being full: it is neither credited nor charged, and
--            when the key has room the waiting tenant whose last turn ended longest ago goes first
--            (so contenders for one key take turns, whatever order the ring visits them in).
-- TURN goes before WAITING. turn_ended_at is when the tenant's last turn in the lane ended.
ALTER TABLE drr_lane_tenant ADD COLUMN paused_on text;
ALTER TABLE drr_lane_tenant ADD COLUMN paused_at timestamptz;
ALTER TABLE drr_lane_tenant ADD COLUMN paused_kind text CHECK (paused_kind IN ('TURN', 'WAITING'));
ALTER TABLE drr_lane_tenant ADD COLUMN turn_ended_at timestamptz;
ALTER TABLE drr_lane_tenant ADD CONSTRAINT drr_paused_together
    CHECK ((paused_on IS NULL) = (paused_at IS NULL) AND (paused_on IS NULL) = (paused_kind IS NULL));
CREATE INDEX drr_lane_paused ON drr_lane_tenant (lane) WHERE paused_kind IS NOT NULL;
