"""Applies the schema migrations on deploy. The CDK app's custom resource (infra_cdk/data.py)
invokes it through the provider framework on Create and on Update, which happens whenever the
migrations' fingerprint changes; the functions that use the schema deploy after it. Delete does
nothing: the database outlives this resource. Locally `aivedio db migrate` does the same."""
from __future__ import annotations

import psycopg
from psycopg.rows import dict_row

from aivedio.bootstrap import apply_config
from aivedio.cloud_config import load_platform_config
from aivedio.config import Clock, ConfigError, settings_from_env
from aivedio.context import database_password
from aivedio.db.migrate import migrate, schema_fingerprint
from aivedio.db.pool import with_password
from aivedio.observability import logger

PHYSICAL_ID = "aivedio-schema"


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    request = event.get("RequestType", "Create")
    if request == "Delete":
        return {"PhysicalResourceId": event.get("PhysicalResourceId", PHYSICAL_ID)}
    settings = settings_from_env()
    if settings.database_url is None:
        raise ConfigError("AIVEDIO_DATABASE_URL: required to migrate")
    password = database_password(settings, settings.database_url)
    url = settings.database_url if password is None else with_password(settings.database_url, password())
    applied = migrate(url)
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
        derived = apply_config(conn, load_platform_config(settings), Clock())
    logger.info("migrations applied", extra={"applied": applied, "request": request, **derived})
    return {"PhysicalResourceId": PHYSICAL_ID,
            "Data": {"Applied": ",".join(f"{v:04d}" for v in applied), "Fingerprint": schema_fingerprint()}}
