"""cdk-nag (AwsSolutions) finds nothing unsuppressed, every suppression says why, and cfn-lint
passes on every synthesized template."""
from __future__ import annotations

import pytest

pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
pytest.importorskip("cdk_nag", reason="the cdk extra is not installed: pip install -e '.[cdk]'")

import json
from pathlib import Path


from infra_cdk.nag import MIN_REASON_CHARS

# W3005: CDK itself writes DependsOn on a function's role next to the GetAtt of that role (and on
# a proxy target group's cluster); the duplicate ordering is harmless and not ours to remove.
CFN_LINT_IGNORED = ["W3005"]


def test_cdk_nag_aws_solutions_finds_nothing_unsuppressed(synth):
    findings = [(level, path, text[:300]) for level, path, text in synth.messages()
                if "AwsSolutions-" in text or "CdkNagValidationFailure" in text]
    assert not findings, "\n".join(map(str, findings))


def test_synthesis_has_no_errors_or_unacknowledged_warnings(synth):
    problems = [(level, path, text[:300]) for level, path, text in synth.messages() if level in ("error", "warning")]
    assert not problems, "\n".join(map(str, problems))


def test_the_nag_pack_ran(synth):
    reports = sorted(p.name for p in synth.outdir.glob("AwsSolutions-*-NagReport.csv"))
    assert len(reports) == 4, reports  # Data and App of dev and prod


def _suppressions(synth):
    for path in synth.outdir.glob("*.template.json"):
        for lid, r in json.loads(path.read_text())["Resources"].items():
            for s in r.get("Metadata", {}).get("cdk_nag", {}).get("rules_to_suppress", []):
                yield path.name, lid, s


def test_every_suppression_is_justified(synth):
    seen = list(_suppressions(synth))
    assert seen, "no suppressions found: did the metadata move?"
    for template, lid, s in seen:
        assert s["id"].startswith("AwsSolutions-"), (template, lid, s)
        assert len(s.get("reason", "")) >= MIN_REASON_CHARS, (template, lid, s)


def test_every_suppression_is_used(synth):
    """A suppression that excuses nothing hides the next real finding on that resource."""
    used = set()
    for report in synth.outdir.glob("AwsSolutions-*-NagReport.csv"):
        for line in report.read_text().splitlines()[1:]:
            cols = [c.strip('"') for c in line.split('","')]
            if cols[2] == "Suppressed":
                used.add((cols[0], cols[1].split("/")[0]))
    declared = {(s["id"], template.removesuffix(".template.json")) for template, _, s in _suppressions(synth)}
    assert declared <= used, f"unused suppressions: {sorted(declared - used)}"


def test_cfn_lint_passes_on_the_synthesized_templates(synth):
    cfnlint_api = pytest.importorskip("cfnlint.api")
    templates = sorted(synth.outdir.glob("*.template.json"))
    assert len(templates) == 4
    config = cfnlint_api.ManualArgs(regions=["us-east-1"], ignore_checks=CFN_LINT_IGNORED)
    problems = []
    for path in templates:
        for m in cfnlint_api.lint_file(Path(path), config=config):
            problems.append(f"{path.name}: {m.rule.id} {m.message} (line {m.linenumber})")
    assert not problems, "\n".join(problems)
