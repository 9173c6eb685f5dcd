"""The media bucket's storage cost, computed by the platform (aivedio.media.storage_cost), on the
real PostgreSQL:

- an object's life follows its retention class's lifecycle (Standard, Standard-IA, Glacier IR,
  expiry), and a task is booked its whole storage life (the media pipeline's test shows the booking,
  in AWS too);
- the CUR's lines of the bucket as a whole (tagged aivedio:cost-scope = media-storage, no tenant)
  are kept apart from the media costs, once however often imported, and never parked;
- each month, the billed TimedStorage lines are checked against what the stored outputs should cost
  in it: within the tolerance MATCHED, beyond it MISMATCH and parked for finance once per figures;
  a month with no bill says so. The CLI runs the check as typed, and after an import for the months
  it brought."""
from __future__ import annotations

import csv
import json
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from aivedio.config import MediaConfig, PlatformConfig, Settings
from aivedio.context import build_platform
from aivedio.media import storage_cost
from aivedio.media.retention import by_name
from aivedio.media.storage_cost import GB, StoragePrices, lifetime_cost, stages
from aivedio.spend import media_costs
from tests.billing_support import ADMIN, Cli, make_task, new_wallet

pytestmark = pytest.mark.timeout(120)
PRICES = StoragePrices("USD", {"STANDARD": Decimal("0.023"), "STANDARD_IA": Decimal("0.0125"), "GLACIER_IR": Decimal("0.004")})
EIGHT = Decimal("0.00000001")
HEADER = ["identity/LineItemId", "lineItem/UsageStartDate", "lineItem/ProductCode", "lineItem/UsageType",
          "lineItem/UnblendedCost", "lineItem/CurrencyCode", "resourceTags/user:aivedio:tenant_id",
          "resourceTags/user:aivedio:cost-scope"]


def q(d: Decimal) -> Decimal:
    return d.quantize(EIGHT)


def test_an_objects_life_follows_its_retention_classs_lifecycle():
    assert stages(by_name("provider-temp")) == [("STANDARD", 0, 2)]
    assert stages(by_name("proxy")) == [("STANDARD", 0, 30), ("STANDARD_IA", 30, 90)]
    assert stages(by_name("final"), 360) == [("STANDARD", 0, 30), ("STANDARD_IA", 30, 180), ("GLACIER_IR", 180, 360)]
    # A GB (2^30 bytes) of proxy: 30 days in Standard, 60 in Standard-IA, in months of 730 hours.
    assert q(lifetime_cost(2 ** 30, "proxy", PRICES, 12)) == q((Decimal("0.023") * 720 + Decimal("0.0125") * 1440) / 730)
    # A final output is never expired: it is booked for the horizon, here 12 months of 30 days.
    assert q(lifetime_cost(2 ** 30, "final", PRICES, 12)) == q(
        (Decimal("0.023") * 720 + Decimal("0.0125") * 3600 + Decimal("0.004") * 4320) / 730)
    assert lifetime_cost(2 ** 30, "final", PRICES, 24) > lifetime_cost(2 ** 30, "final", PRICES, 12)
    assert lifetime_cost(3 * 2 ** 30, "proxy", PRICES, 12) == 3 * lifetime_cost(2 ** 30, "proxy", PRICES, 12)
    assert lifetime_cost(0, "final", PRICES, 12) == 0


# Outputs stored in 2031, far from every other row of this module's database (its own database).
FINAL_BIG = (datetime(2031, 1, 10, 9, tzinfo=timezone.utc), 10 * 2 ** 30)  # final: Standard-IA from Feb 9 12:00
PROXY = (datetime(2031, 1, 20, 15, tzinfo=timezone.utc), 5 * 2 ** 30)  # proxy: IA from Feb 19 12:00, gone Apr 20 12:00
FINAL_LATE = (datetime(2031, 3, 16, 1, tzinfo=timezone.utc), 2 ** 30)  # final: Standard from Mar 16 12:00
PROXY_GONE = (datetime(2030, 11, 1, 8, tzinfo=timezone.utc), 7 * 2 ** 30)  # expired on Jan 30 12:00, before March
# March 2031 (744 hours): the big final and the proxy in IA all month, the late final 372 hours in Standard.
MARCH = q(Decimal(10) * Decimal("0.0125") + Decimal(5) * Decimal("0.0125") + Decimal("0.023") * 372 / 744)


@pytest.fixture(scope="module")
def world(db_url):
    from tests.conftest import TEST_HOME

    p = build_platform(Settings(database_url=db_url, redis_url="none", home=TEST_HOME), PlatformConfig(), pool_size=2)
    w = new_wallet(p)

    def output(conn, stored: tuple[datetime, int], *, interactive: bool) -> None:
        task_id = make_task(conn, w)
        conn.execute("update generation_task set interactive = %s where task_id = %s", (interactive, task_id))
        conn.execute("""insert into task_output (task_id, tenant_id, output_version, asset_type, object_key, size_bytes, created_at)
                        values (%s, %s, 1, 'delivery', %s, %s, %s)""",
                     (task_id, w.tenant_id, f"outputs/{w.tenant_id}/{task_id}/v1/delivery.mp4", stored[1], stored[0]))

    def seed(conn):
        output(conn, FINAL_BIG, interactive=False)
        output(conn, PROXY, interactive=True)
        output(conn, FINAL_LATE, interactive=False)
        output(conn, PROXY_GONE, interactive=True)

    p.db.transaction(seed)
    yield p, w
    p.close()


def cur_file(path, lines: list[tuple[str, str, str, str]], *, tenant: str = "", scope: str = "media-storage") -> str:
    """lines: (line item id, usage start, usage type, cost) of the media bucket's S3 usage."""
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([HEADER, *[(i, start, "AmazonS3", usage, cost, "USD", tenant, scope)
                                           for i, start, usage, cost in lines]])
    return str(path)


def test_the_expected_month_counts_each_output_in_the_class_its_age_puts_it_in(world, conn):
    assert q(storage_cost.expected_month(conn, date(2031, 3, 1), PRICES)) == MARCH
    # December 2030: only the old proxy, its last 12 hours in Standard, then Standard-IA from Dec 1 12:00.
    assert q(storage_cost.expected_month(conn, date(2030, 12, 1), PRICES)) == q(
        (Decimal(7) * Decimal("0.023") * 12 + Decimal(7) * Decimal("0.0125") * (744 - 12)) / 744)
    assert storage_cost.expected_month(conn, date(2030, 9, 1), PRICES) == 0  # nothing stored yet


def test_bucket_lines_are_kept_apart_once_and_the_month_is_checked(world, conn, db_url, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    cli = Cli(monkeypatch)
    # Two TimedStorage lines (Standard and Standard-IA) summing to 1 % under the expectation, and
    # the bucket's requests, which the check leaves out.
    billed = q(MARCH * Decimal("0.99"))
    path = cur_file(tmp_path / "cur-2031-03.csv", [
        ("li-std", "2031-03-01T00:00:00Z", "USE1-TimedStorage-ByteHrs", "0.01000000"),
        ("li-ia", "2031-03-01T00:00:00Z", "USE1-TimedStorage-SIA-ByteHrs", str(billed - Decimal("0.01"))),
        ("li-req", "2031-03-01T00:00:00Z", "USE1-Requests-Tier1", "0.50000000")])
    before = {t: conn.execute(f"select count(*) as n from {t}").fetchone()["n"]
              for t in ("media_cost_event", "billing_parked_event", "bucket_storage_cost")}
    for run in (1, 2):
        assert cli.main(["admin", "media-costs", "import", "--file", path, "--json", "--operator", ADMIN]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["bucket_storage"] == {"recorded": 3 if run == 1 else 0, "already_recorded": 0 if run == 1 else 3,
                                         "months": ["2031-03-01"]}
        assert (doc["recorded"], doc["unattributed"], doc["parked_new"]) == (0, 0, 0)
        [check] = doc["storage_checks"]
        assert (check["status"], Decimal(check["expected"]), Decimal(check["billed"])) == ("MATCHED", MARCH, billed)
    after = {t: conn.execute(f"select count(*) as n from {t}").fetchone()["n"]
             for t in ("media_cost_event", "billing_parked_event", "bucket_storage_cost")}
    assert after == {**before, "bucket_storage_cost": before["bucket_storage_cost"] + 3}


def test_a_month_billed_beyond_the_tolerance_is_parked_once(world, conn, db_url, monkeypatch, capsys, tmp_path):
    p, w = world
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    cli = Cli(monkeypatch)
    april = p.db.transaction(lambda c: storage_cost.expected_month(c, date(2031, 4, 1), PRICES))
    over = q(april * Decimal("1.2"))  # 20 % over, the tolerance is 5 %
    path = cur_file(tmp_path / "cur-2031-04.csv", [("li-apr", "2031-04-01T00:00:00Z", "USE1-TimedStorage-ByteHrs", str(over))])
    assert cli.main(["admin", "media-costs", "import", "--file", path, "--json", "--operator", ADMIN]) == 0
    [check] = json.loads(capsys.readouterr().out)["storage_checks"]
    assert (check["status"], Decimal(check["billed"]), Decimal(check["expected"])) == ("MISMATCH", over, q(april))
    for _ in range(2):  # the check again, as typed: the same figures park nothing more
        assert cli.main(["admin", "media-costs", "check-storage", "--month", "2031-04", "--json", "--operator", ADMIN]) == 0
        assert json.loads(capsys.readouterr().out)["status"] == "MISMATCH"
    [item] = conn.execute("select * from billing_parked_event where reason = 'STORAGE_COST_MISMATCH'").fetchall()
    assert item["status"] == "OPEN" and item["payload"]["month"] == "2031-04-01" and "expected" in item["detail"]
    # A wider tolerance (the config's) lets the same month pass.
    wide = MediaConfig(storage_check_tolerance_pct=25)
    assert p.db.transaction(lambda c: storage_cost.check_month(c, date(2031, 4, 1), wide))["status"] == "MATCHED"


def test_a_month_without_a_bill_and_bad_input(world, monkeypatch, db_url, capsys):
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    cli = Cli(monkeypatch)
    assert cli.main(["admin", "media-costs", "check-storage", "--month", "2031-05", "--json", "--operator", ADMIN]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "NO_BILL" and Decimal(doc["expected"]) > 0
    with pytest.raises(SystemExit) as e:
        cli.main(["admin", "media-costs", "check-storage", "--month", "May 2031", "--json"])
    assert e.value.code == 2 and "YYYY-MM" in capsys.readouterr().err


def test_a_tenant_tagged_storage_line_is_still_a_tenants_media_cost(world, conn, tmp_path):
    """Only the bucket's own lines (no tenant, the bucket's scope) are kept apart."""
    p, w = world
    path = cur_file(tmp_path / "cur-tenant.csv", [("li-t", "2031-03-02T00:00:00Z", "USE1-TimedStorage-ByteHrs", "0.0042")],
                    tenant=str(w.tenant_id), scope="")
    doc = p.db.transaction(lambda c: media_costs.import_cur(c, operator=ADMIN, path=path, currencies=("USD",)))
    assert (doc["recorded"], doc["bucket_storage"]["recorded"]) == (1, 0)
    assert GB == 2 ** 30
