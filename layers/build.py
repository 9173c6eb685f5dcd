"""Build the two Lambda layers without Docker.

    python layers/build.py            # -> build/layer/python/{aivedio, its dependencies}
                                      #    build/layer-media/python/{av}

The core layer (build/layer) is every function's: the runtime package and its dependencies but
PyAV. The media layer (build/layer-media) holds PyAV alone, with the FFmpeg it bundles (about 100
MiB of the 130 the one layer weighed): only the functions that open media with it
(FunctionProfile.parses_media in infra_cdk/functions.py) load it, so the relay, the tick and the
others start from a layer a quarter of the size. tests/integration/test_lambda_cold_start.py
starts every other handler without PyAV, and checks that exactly the functions whose imports reach
it are marked.

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

Both layers ship their bytecode, compiled by a python of the Lambda's version (unchecked-hash, so
the .pyc files stay valid inside the zip whatever their timestamps): Lambda's /opt is read-only, so
without them every cold start compiles everything it imports, which is most of a handler's import
time (aivedio bench --only layers measures both). Without such a python here the build says so and
ships the sources alone, as before.

The CDK app (infra_cdk/functions.py) deploys build/layer with `Code.from_asset`. Synthesis does
not need the layer when `-c layer=stub` is given; the infra tests use that (see infra_cdk/README.md).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
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
MEDIA_LAYER_DIR = ROOT / "build" / "layer-media"
MEDIA_SITE_DIR = MEDIA_LAYER_DIR / "python"
MEDIA_STAMP = MEDIA_LAYER_DIR / ".deps-stamp"
MEDIA_REQUIREMENTS = {"av"}  # PyAV and the FFmpeg it bundles: the media layer's only content
MEDIA_MODULES = {"av"}  # the import names a module that needs the media layer imports

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


def core_requirements() -> list[str]:
    """What the core layer installs: the runtime dependencies but PyAV."""
    return [r for r in runtime_requirements() if _name(r) not in MEDIA_REQUIREMENTS]


def media_requirements() -> list[str]:
    return [r for r in runtime_requirements() if _name(r) in MEDIA_REQUIREMENTS]


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


def lambda_python(version: str = PYTHON_VERSION) -> str | None:
    """A python of the Lambda's version that runs (python3.12 on PATH, else a pyenv one; a pyenv
    shim on PATH may refuse a version that is not selected), or None."""
    candidates = [shutil.which(f"python{version}"),
                  *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}")), reverse=True)]
    for c in filter(None, candidates):
        done = subprocess.run([c, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                              text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip() == version:
            return c
    return None


def compile_bytecode(directory: Path) -> bool:
    """Compile every .py under `directory` for the Lambda's python; False (and a note) without one."""
    python = lambda_python()
    if python is None:
        print(f"layer: no python{PYTHON_VERSION} here: {directory} ships without bytecode (each cold start "
              "compiles what it imports)", file=sys.stderr)
        return False
    subprocess.run([python, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash", str(directory)],
                   check=True, stdout=subprocess.DEVNULL)
    return True


def refresh_package(site: Path = SITE_DIR) -> Path:
    """copy_package, then its bytecode (unchecked-hash .pyc must never outlive their source)."""
    dest = copy_package(site)
    compile_bytecode(dest)
    return dest


def _install(requirements: list[str], site: Path, stamp_file: Path, force: bool) -> None:
    stamp = _stamp(requirements)
    if force or not stamp_file.exists() or stamp_file.read_text() != stamp or not site.is_dir():
        if site.exists():
            shutil.rmtree(site)
        site.mkdir(parents=True)
        subprocess.run(pip_command(requirements, site), check=True)
        for cache in site.rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)
        compile_bytecode(site)
        stamp_file.write_text(stamp)


def stale(which: str = "core") -> bool:
    """Whether a layer's installed dependencies differ from pyproject.toml's (or it is not built)."""
    stamp_file, requirements = (STAMP, core_requirements()) if which == "core" else (MEDIA_STAMP, media_requirements())
    return not stamp_file.exists() or stamp_file.read_text() != _stamp(requirements)


def build(force: bool = False) -> dict[str, Path]:
    """Both layers: {"core": build/layer, "media": build/layer-media}."""
    _install(core_requirements(), SITE_DIR, STAMP, force)
    _install(media_requirements(), MEDIA_SITE_DIR, MEDIA_STAMP, force)
    refresh_package()
    return {"core": LAYER_DIR, "media": MEDIA_LAYER_DIR}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="reinstall the dependencies even if unchanged")
    ap.add_argument("--print-command", action="store_true", help="print the pip command and exit")
    args = ap.parse_args(argv)
    if args.print_command:
        print(" ".join(pip_command(core_requirements())))
        print(" ".join(pip_command(media_requirements(), MEDIA_SITE_DIR)))
        return 0
    out = build(force=args.force)
    sizes = {which: unzipped_size(d) for which, d in out.items()}
    for which, d in out.items():
        print(f"layer {which}: {d} ({sizes[which] / 2**20:.1f} MiB unzipped)")
    both = sum(sizes.values())
    print(f"layers: {both / 2**20:.1f} MiB together, of Lambda's {LAMBDA_UNZIPPED_LIMIT_BYTES / 2**20:.0f} MiB "
          "for a function's layers and code")
    if both > LAMBDA_UNZIPPED_LIMIT_BYTES:
        print("layers: over Lambda's unzipped limit; the media functions would not deploy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
