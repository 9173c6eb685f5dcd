"""layers/build.py: the layer's pip command and contents, without running pip (no network)."""
from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

from layers import build

ROOT = Path(__file__).resolve().parents[2]


def test_requirements_are_the_runtime_dependencies_minus_the_lambda_runtimes_own():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = build.runtime_requirements()
    assert not [r for r in reqs if r.lower().startswith(("boto3", "botocore"))]
    assert set(reqs) == {d for d in deps if not d.lower().startswith(("boto3", "botocore"))}
    assert any(r.startswith("psycopg[") for r in reqs) and any(r.startswith("aws-lambda-powertools") for r in reqs)


def test_pyav_goes_to_the_media_layer_alone():
    core, media = build.core_requirements(), build.media_requirements()
    assert [build._name(r) for r in media] == ["av"]
    assert not [r for r in core if build._name(r) == "av"]
    assert sorted(core + media) == sorted(build.runtime_requirements())
    cmd = build.pip_command(media, build.MEDIA_SITE_DIR)
    assert cmd[cmd.index("--target") + 1] == str(ROOT / "build" / "layer-media" / "python")


def test_pip_installs_linux_wheels_for_the_lambda_python_without_docker():
    cmd = build.pip_command(["pydantic>=2"])
    flags = " ".join(cmd)
    assert "--platform manylinux2014_x86_64" in flags
    assert "--implementation cp" in flags
    assert f"--python-version {build.PYTHON_VERSION}" in flags and build.PYTHON_VERSION == "3.12"
    assert "--only-binary=:all:" in flags
    assert cmd[cmd.index("--target") + 1] == str(ROOT / "build" / "layer" / "python")
    assert cmd[-1] == "pydantic>=2"


def test_the_package_is_copied_into_the_layer(tmp_path):
    build.copy_package(tmp_path)
    assert (tmp_path / "aivedio" / "config.py").is_file()
    assert (tmp_path / "aivedio" / "db" / "migrations").is_dir()
    assert not list(tmp_path.rglob("__pycache__"))


def test_the_stamp_changes_with_the_requirements():
    assert build._stamp(["a"]) != build._stamp(["a", "b"])
    assert build._stamp(["a"]) == build._stamp(["a"])


def test_the_package_ships_its_bytecode_for_the_lambdas_python(tmp_path):
    python = build.lambda_python()
    if python is None:
        pytest.skip(f"no python{build.PYTHON_VERSION} here: the layer build ships sources alone, and says so")
    dest = build.refresh_package(tmp_path)
    sources = {p.relative_to(dest).with_suffix("") for p in dest.rglob("*.py")}
    compiled = {p.parent.parent.relative_to(dest) / p.name.split(".")[0] for p in dest.rglob("__pycache__/*.pyc")}
    assert sources and sources == compiled
    assert all(f"cpython-{build.PYTHON_VERSION.replace('.', '')}" in p.name for p in dest.rglob("*.pyc"))
    # Unchecked-hash: the Lambda's python loads them as they are, never recompiling into read-only /opt.
    for pyc in dest.rglob("*.pyc"):
        assert int.from_bytes(pyc.read_bytes()[4:8], "little") == 0b01, pyc  # hash-based, unchecked (PEP 552)
    done = subprocess.run([python, "-S", "-c", "import aivedio.errors as m; print(m.__spec__.cached)"],
                          env={"PYTHONPATH": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_file()
