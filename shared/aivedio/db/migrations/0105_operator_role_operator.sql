-- 0105: the OPERATOR role (aivedio.policy.roles): reviews, dead letters, rebuilds and repairs.
ALTER TABLE operator_role DROP CONSTRAINT operator_role_role_check;
ALTER TABLE operator_role ADD CONSTRAINT operator_role_role_check
    CHECK (role IN ('BILLING_ADMIN', 'SUPPORT', 'FINANCE_APPROVER', 'AUDITOR', 'OPERATOR'));
