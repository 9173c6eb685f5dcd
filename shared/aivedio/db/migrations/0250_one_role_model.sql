-- One role model (docs/operations.md "Who may do what"): an operator of the admin API has one role of
-- aivedio.policy.roles (viewer, operator, finance, admin), checked by the admin API on its token. The
-- CLI runs with the database's credentials and is trusted, so nothing reads operator_role, the CLI's
-- second role system (BILLING_ADMIN, OPERATOR, SUPPORT, FINANCE_APPROVER, AUDITOR), any more. Its
-- grants are kept in the audit log (operator.grant, operator.revoke); the table goes.
DROP TABLE IF EXISTS operator_role;
