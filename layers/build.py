"""Build the one shared Lambda layer without Docker.

    python layers/build.py            # -> build/layer/python/{aivedio, its dependencies}

The dependencies are the runtime `dependencies` of pyproject.toml, installed as Linux wheels for
the Lambda runtime (`pip install --platform ... --implementation cp --python-version 3.12
--only-binary=:all:`), so the build works on any machine with pip and network access to the
package index, and never compiles anything. boto3/botocore are left out: the Lambda runtime ships
them, and they would add ~25 MB. Then shared/aivedio, the runtime package, is copied in whole: it
holds only what a function runs. The tools around it (the local runtime, the CLI, demo, bench,
simulate, chaos, the provider simulator) are the other package, shared/aivedio_tools, which never
reaches the layer; tests/unit/test_house.py fails if the runtime package imports it.

pip runs only when the dependency list, the Python version or the platforms change (a stamp file
records them); the package copy is refreshed every time, so `make synth` stays fast.

The CDK app (infra_cdk/functions.py) deploys build/layer with `Code.from_asset`. Synthesis does
not need the layer when `-c layer=stub` is given; the infra tests use that (see infra_cdk/README.md).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER_DIR = ROOT / "build" / "layer"
SITE_DIR = LAYER_DIR / "python"  # Lambda puts /opt/python on sys.path
PACKAGE_SRC = ROOT / "shared" / "aivedio"
STAMP = LAYER_DIR / ".deps-stamp"

PYTHON_VERSION = "3.12"  # the Lambda runtime of every function (infra_cdk reads this constant)
ARCHITECTURE = "x86_64"
# manylinux2014 is the baseline; Lambda's python3.12 runs on Amazon Linux 2023 (glibc 2.34), so
# manylinux_2_28 wheels (which some packages publish instead) run there too.
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")
PROVIDED_BY_RUNTIME = {"boto3", "botocore"}
TOOLS_PACKAGE = "aivedio_tools"  # never in the layer
LAMBDA_UNZIPPED_LIMIT_BYTES = 250 * 1024 * 1024  # layers and function code together


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def runtime_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The distribution's runtime dependencies, minus what the Lambda runtime provides."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if _name(d) not in PROVIDED_BY_RUNTIME]


def pip_command(requirements: list[str], target: Path = SITE_DIR) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--upgrade",
           "--implementation", "cp", "--python-version", PYTHON_VERSION, "--only-binary=:all:",
           "--target", str(target)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + requirements


def _stamp(requirements: list[str]) -> str:
    blob = json.dumps({"requirements": requirements, "python": PYTHON_VERSION, "platforms": PLATFORMS})
    return hashlib.sha256(blob.encode()).hexdigest()


def copy_package(site: Path = SITE_DIR, src: Path = PACKAGE_SRC) -> Path:
    """shared/aivedio into site/aivedio, whole, without caches."""
    dest = site / "aivedio"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return dest


def unzipped_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def build(force: bool = False) -> Path:
    requirements = runtime_requirements()
    stamp = _stamp(requirements)
    if force or not STAMP.exists() or STAMP.read_text() != stamp or not SITE_DIR.is_dir():
        if SITE_DIR.exists():
            shutil.rmtree(SITE_DIR)
        SITE_DIR.mkdir(parents=True)
        subprocess.run(pip_command(requirements), check=True)
        for cache in SITE_DIR.rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)
        STAMP.write_text(stamp)
    copy_package()
    return LAYER_DIR


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="reinstall the dependencies even if unchanged")
    ap.add_argument("--print-command", action="store_true", help="print the pip command and exit")
    args = ap.parse_args(argv)
    if args.print_command:
        print(" ".join(pip_command(runtime_requirements())))
        return 0
    out = build(force=args.force)
    size = unzipped_size(out)
    print(f"layer: {out} ({size / 2**20:.1f} MiB unzipped of Lambda's {LAMBDA_UNZIPPED_LIMIT_BYTES / 2**20:.0f} MiB "
          "for layers and function code together)")
    if size > LAMBDA_UNZIPPED_LIMIT_BYTES:
        print("layer: over Lambda's unzipped limit; the functions would not deploy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
