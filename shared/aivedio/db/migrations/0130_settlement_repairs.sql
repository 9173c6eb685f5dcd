-- 0130: what the settlement repairs read (aivedio.reconcile.unsettled_terminals).
-- A terminal task whose charge snapshot is still open is found among the open snapshots (the tasks
-- in flight, a small set) rather than by a scan of every charge ever made; the finalize update
-- already leaves the heap-only path (idx_generation_charge_finalized), so this costs one index
-- entry per admission and nothing more.
CREATE INDEX idx_generation_charge_unfinalized ON generation_charge (task_id) WHERE finalized_at IS NULL;

-- The terminal event of a task, read back from the outbox whatever became of its delivery (one
-- row per finished task; status updates do not touch these columns).
CREATE INDEX idx_outbox_terminal_event_task ON outbox_event (aggregate_id)
    WHERE event_type IN ('TaskSucceeded', 'TaskFailed', 'TaskCancelled');
