"""`aivedio bench`: the platform's speed, always beside a baseline measured in the same run on the
same machine (pgbench on the same PostgreSQL), so figures are ratios rather than noisy absolutes."""
