-- 0090: money controls on refunds (ch. 20.13.5 "大额退款和补偿采用双人审批", "限制单人、单日的操作额度").
-- A refund above BillingConfig.refund_dual_approval_above waits in PENDING_APPROVAL and moves no
-- money until an operator other than its requester approves it; it then goes on as any refund does
-- (COMPLETED at once, or PENDING_SETTLEMENT until its task settles). A rejected one is REJECTED,
-- with who rejected it and why.
ALTER TABLE refund_request DROP CONSTRAINT refund_request_state_check;
ALTER TABLE refund_request
    ADD CONSTRAINT refund_request_state_check
        CHECK (state IN ('PENDING_APPROVAL', 'PENDING_SETTLEMENT', 'COMPLETED', 'REJECTED')),
    ADD COLUMN approved_by text,
    ADD COLUMN approved_at timestamptz,
    ADD COLUMN rejected_by text,
    -- four eyes: the approver is never the requester
    ADD CONSTRAINT refund_request_approver_not_requester CHECK (approved_by IS NULL OR approved_by <> requested_by),
    ADD CONSTRAINT refund_request_approval_complete CHECK ((approved_by IS NULL) = (approved_at IS NULL)),
    ADD CONSTRAINT refund_request_pending_approval_unapproved CHECK (state <> 'PENDING_APPROVAL' OR approved_by IS NULL);

-- The per-operator daily refund limit sums an operator's refunds of one UTC day: those it requested
-- (by created_at) and those it approved (by approved_at).
CREATE INDEX idx_refund_request_requester_day ON refund_request (requested_by, created_at);
CREATE INDEX idx_refund_request_approver_day ON refund_request (approved_by, approved_at) WHERE approved_by IS NOT NULL;
