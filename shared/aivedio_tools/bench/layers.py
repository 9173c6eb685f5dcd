"""Each function's layers, from the built layers (`make layer`): their unzipped size, and the cold
import of its handler, as Lambda runs it: a fresh python of the layers' version, nothing on its
path but the functions/ tree and the function's own layers (no site-packages, no venv), and no
bytecode written (Lambda's /opt is read-only, so every cold start compiles what it imports).

The baseline, in the same run and alternating with it, is the shape before: every function
loading the core and the media layer together, as the one layer held both, and without bytecode,
as it shipped (each cold start compiled what it imported). `own_layers_without_bytecode_ms`
separates the two changes. boto3 is not on the path (the Lambda runtime provides it, and no
handler imports it at start-up).

    bench_layers(rounds=3)   # {"python", "layers": {name: MiB}, "functions": {name: {...}}}
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from aivedio_tools.bench.rounds import alternate

CHECKOUT = Path(__file__).resolve().parents[3]  # the repository: layers/ and infra_cdk/ beside shared/

IMPORT_ONE = r"""
import json, sys, time
t0 = time.perf_counter()
import importlib
mod = importlib.import_module(f"functions.{sys.argv[1]}.handler")
assert callable(mod.lambda_handler)
print(json.dumps({"seconds": time.perf_counter() - t0, "av": "av" in sys.modules}))
"""


class LayersNotBuilt(Exception):
    pass


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


def bench_layers(rounds: int = 3) -> dict:
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    from infra_cdk.functions import PROFILES, discover  # lazy: aws_cdk (the cdk extra), only for this bench
    from layers import build  # lazy: the checkout's layer build, not a package of the distribution

    if not (build.SITE_DIR / "aivedio").is_dir() or not build.MEDIA_SITE_DIR.is_dir() or build.stale("core") or build.stale("media"):
        raise LayersNotBuilt(f"{build.LAYER_DIR} or {build.MEDIA_LAYER_DIR} is missing or stale: run `make layer`")
    python = build.lambda_python()
    if python is None:
        raise LayersNotBuilt(f"no python{build.PYTHON_VERSION} here (the layers' wheels are built for it)")
    build.refresh_package()  # the core's aivedio as shared/aivedio is now, and its bytecode
    sizes = {"core": build.unzipped_size(build.LAYER_DIR), "media": build.unzipped_size(build.MEDIA_LAYER_DIR)}
    with tempfile.TemporaryDirectory(prefix="aivedio-bench-layers-") as tmp:
        task, plain = Path(tmp) / "task", Path(tmp) / "sources-only"
        shutil.copytree(CHECKOUT / "functions", task / "functions", ignore=shutil.ignore_patterns("__pycache__"))
        sites = {"core": build.SITE_DIR, "media": build.MEDIA_SITE_DIR}
        # The layers as they shipped before: the same files without their bytecode.
        no_bytecode = {w: shutil.copytree(d, plain / w, ignore=shutil.ignore_patterns("__pycache__")) for w, d in sites.items()}
        sizes_before = sum(build.unzipped_size(d) for d in no_bytecode.values())

        def cold_import(name: str, layers: list[str], where: dict[str, Path]) -> dict:
            env = {"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1",
                   "PYTHONPATH": ":".join([str(task), *(str(where[w]) for w in layers)]),
                   "AWS_LAMBDA_FUNCTION_NAME": f"aivedio-bench-{name}", "AWS_REGION": "eu-west-1",
                   "AWS_DEFAULT_REGION": "eu-west-1"}
            done = subprocess.run([python, "-S", "-c", IMPORT_ONE, name], cwd=task, env=env, capture_output=True,
                                  text=True, timeout=120)
            if done.returncode != 0:
                return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
            return json.loads(done.stdout.strip().splitlines()[-1])

        def median_ms(results: list[dict]) -> float | None:
            got = sorted(r["seconds"] * 1000 for r in results if "seconds" in r)
            return round(got[len(got) // 2], 1) if got else None

        functions = {}
        for name in discover():
            own = ["core", *(["media"] if PROFILES[name].parses_media else [])]
            runs = alternate(lambda _i, n=name, o=own: cold_import(n, o, sites),
                             lambda _i, n=name: cold_import(n, ["core", "media"], no_bytecode),
                             rounds=rounds, figure=lambda r: r.get("seconds"), baseline_figure=lambda r: r.get("seconds"))
            sources_only = [cold_import(name, own, no_bytecode) for _ in range(rounds)]
            results = [r[k] for r in runs["rounds"] for k in ("bench", "baseline")] + sources_only
            errors = sorted({r["error"] for r in results if "error" in r})
            functions[name] = {
                "layers": own, "size_mib": _mib(sum(sizes[w] for w in own)), "before_size_mib": _mib(sizes_before),
                "cold_import_ms": median_ms([r["bench"] for r in runs["rounds"]]),
                "before_cold_import_ms": median_ms([r["baseline"] for r in runs["rounds"]]),
                "own_layers_without_bytecode_ms": median_ms(sources_only),
                "ratio": runs["ratio"], "loads_pyav_at_start": any(r.get("av") for r in results),
                **({"errors": errors} if errors else {}),
            }
    return {"python": python, "rounds": rounds, "layers_mib": {w: _mib(n) for w, n in sizes.items()},
            "before_layer_mib": _mib(sizes_before), "functions": functions}
