"""The CDK app: `python -m infra_cdk.app` (what cdk.json runs). Offline: no Docker, no AWS
credentials, no context lookups.

Context:
  stage=dev|prod|dev,prod   which stage(s) to synthesize (default dev)
  layer=build|stub          build: deploy build/layer (run `make layer` first); stub: an empty
                            layer, for tests and template inspection only (default build)
  render_image=auto|asset|ecr   the gpu-render image source (infra_cdk/media.py; default auto)
  nag=true|false            run cdk-nag AwsSolutions checks (default true)
  account=..., region=...   pin the stacks to an environment (default: environment-agnostic)
The output directory is CDK_OUTDIR (the cdk CLI sets it) or ./cdk.out."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "shared"):  # infra_cdk, layers and the aivedio core import from the tree
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

import aws_cdk as cdk  # noqa: E402
from cdk_nag import AwsSolutionsChecks  # noqa: E402

from infra_cdk.stacks import UNTAGGABLE, AppStack, DataStack  # noqa: E402
from infra_cdk.stages import STAGES, stage_names  # noqa: E402


def _flag(value: object, default: bool) -> bool:
    if value is None:
        return default
    return str(value).lower() in ("1", "true", "yes", "on")


# Feature flags set in code, so `python -m infra_cdk.app`, the cdk CLI and the tests (which build
# cdk.App themselves) synthesize the same templates.
FEATURE_FLAGS = {
    "@aws-cdk/aws-s3:serverAccessLogsUseBucketPolicy": True,  # log delivery by bucket policy, not ACLs
    "@aws-cdk/aws-lambda:recognizeLayerVersion": True,
    "@aws-cdk/aws-iam:minimizePolicies": True,
    "@aws-cdk/core:includePrefixInUniqueNameGeneration": True,
    # Exports between the data and app stacks stay "strong": CloudFormation refuses to delete an
    # export still imported, so the data stack cannot lose a value the app stack uses.
    "@aws-cdk/core:defaultCrossStackReferences": "strong",
}


def build(app: cdk.App) -> dict[str, tuple[DataStack, AppStack]]:
    """Add the stacks of every requested stage to `app`; returns them by stage name."""
    ctx = app.node.try_get_context
    for flag, value in FEATURE_FLAGS.items():
        if ctx(flag) is None:
            app.node.set_context(flag, value)
    account, region = ctx("account"), ctx("region")
    env = cdk.Environment(account=account, region=region) if account or region else None
    layer_mode = ctx("layer") or "build"
    out: dict[str, tuple[DataStack, AppStack]] = {}
    for name in stage_names(ctx("stage")):
        stage = STAGES[name]
        data = DataStack(app, f"AiVedio-{name}-Data", stage=stage, env=env)
        appstack = AppStack(app, f"AiVedio-{name}-App", stage=stage, data=data, layer_mode=layer_mode,
                            render_image=ctx("render_image"), env=env)
        out[name] = (data, appstack)
    cdk.Tags.of(app).add("aivedio:app", "aivedio", exclude_resource_types=UNTAGGABLE)
    if _flag(ctx("nag"), True):
        cdk.Aspects.of(app).add(AwsSolutionsChecks(verbose=True))
    return out


def findings(assembly) -> tuple[list[str], list[str]]:
    """Errors and warnings of a synthesized assembly (cdk-nag reports through these)."""
    errors, warnings = [], []
    for stack in assembly.stacks:
        for m in stack.messages:
            line = f"{m.id}: {m.entry.data}"
            if m.level == "error":
                errors.append(line)
            elif m.level == "warning":
                warnings.append(line)
    return errors, warnings


def main() -> int:
    app = cdk.App()
    build(app)
    assembly = app.synth()
    # The cdk CLI fails on error annotations; `python -m infra_cdk.app` must too.
    errors, warnings = findings(assembly)
    for w in warnings:
        print(f"warning {w}", file=sys.stderr)
    for e in errors:
        print(f"error   {e}", file=sys.stderr)
    print(f"synthesized {', '.join(s.stack_name for s in assembly.stacks)} into {assembly.directory}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
