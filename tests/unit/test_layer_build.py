"""layers/build.py: the layer's pip command and contents, without running pip (no network)."""
from __future__ import annotations

import tomllib
from pathlib import Path

from layers import build

ROOT = Path(__file__).resolve().parents[2]


def test_requirements_are_the_runtime_dependencies_minus_the_lambda_runtimes_own():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = build.runtime_requirements()
    assert not [r for r in reqs if r.lower().startswith(("boto3", "botocore"))]
    assert set(reqs) == {d for d in deps if not d.lower().startswith(("boto3", "botocore"))}
    assert any(r.startswith("psycopg[") for r in reqs) and any(r.startswith("aws-lambda-powertools") for r in reqs)


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
