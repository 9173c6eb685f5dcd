"""One synthesis of the whole CDK app per test session, both stages (`-c stage=dev,prod`), with
the stub layer (`-c layer=stub`: the real layer downloads wheels; layers/build.py has its own unit
tests). Every infra test reads the cloud assembly this writes: the templates, cdk-nag's findings
(stack messages) and the staged assets.

Each test module starts with `pytest.importorskip("aws_cdk")`, so without the cdk extra they are
reported as skipped; `make test` installs it. The infra tests share the xdist group "cdk-synth", so under `pytest -n N --dist loadgroup` they
run in one worker and the app is synthesized once."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

STAGES = ("dev", "prod")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.xdist_group("cdk-synth"))


@dataclass
class Synth:
    outdir: Path
    seconds: float
    assembly: Any
    stacks: dict[str, tuple[Any, Any]]  # stage -> (DataStack, AppStack)
    _templates: dict[str, dict] = field(default_factory=dict)

    def template_json(self, stage: str, kind: str) -> dict:
        name = f"AiVedio-{stage}-{kind}"
        if name not in self._templates:
            self._templates[name] = json.loads((self.outdir / f"{name}.template.json").read_text())
        return self._templates[name]

    def template(self, stage: str, kind: str):
        from aws_cdk.assertions import Template

        return Template.from_json(self.template_json(stage, kind))

    def resources(self, stage: str, kind: str, type_: str) -> dict[str, dict]:
        return {k: v for k, v in self.template_json(stage, kind)["Resources"].items() if v["Type"] == type_}

    def messages(self) -> list[tuple[str, str, str]]:
        """(level, construct path, text) of every stack message (cdk-nag findings included)."""
        out = []
        for stack in self.assembly.stacks:
            for m in stack.messages:
                data = m.entry.data
                out.append((m.level, m.id, data if isinstance(data, str) else json.dumps(data)))
        return out


@pytest.fixture(scope="session")
def synth(tmp_path_factory) -> Synth:
    import aws_cdk as cdk

    from infra_cdk.app import build

    outdir = tmp_path_factory.mktemp("cdk.out")
    t0 = time.monotonic()
    app = cdk.App(outdir=str(outdir), context={"stage": ",".join(STAGES), "layer": "stub"})
    stacks = build(app)
    assembly = app.synth()
    seconds = time.monotonic() - t0
    print(f"\ncdk synth (dev+prod, cdk-nag): {seconds:.1f}s")
    return Synth(outdir=outdir, seconds=seconds, assembly=assembly, stacks=stacks)


@pytest.fixture(scope="session", params=STAGES)
def stage(request) -> str:
    return request.param
