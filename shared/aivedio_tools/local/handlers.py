"""The Lambda handlers of functions/, loaded by module name as Lambda does, and the local stand-in for
API Gateway that serves the tenant API with the admin API's paths on the same port. Both the
runtime behind `aivedio serve` and each process of `serve --api-workers` use them."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aivedio_tools.local.http_server import LambdaHttpServer, Mount

REPO_ROOT = Path(__file__).resolve().parents[3]  # shared/aivedio_tools/local/handlers.py -> repo
API_HANDLER = "functions.api.handler"
ADMIN_API_HANDLER = "functions.admin_api.handler"
ADMIN_API_PREFIXES = ("/admin", "/dashboard")  # the admin API's own REST API in AWS (infra_cdk/admin_api.py)

def load_handler(module: str, attr: str = "lambda_handler") -> Callable[[dict, Any], Any]:
    """Import a Lambda handler from functions/. That tree is deployed as function code, not
    installed by pip, so the repository root joins sys.path when it is not importable yet."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != "functions" or not (REPO_ROOT / "functions").is_dir():
            raise
        sys.path.insert(0, str(REPO_ROOT))
        mod = importlib.import_module(module)
    return getattr(mod, attr)


def api_server(host: str, port: int, *, reuse_port: bool = False) -> LambdaHttpServer:
    """The local API Gateway: the tenant API, with the admin API's paths on the same port."""
    admin = Mount(ADMIN_API_PREFIXES, load_handler(ADMIN_API_HANDLER), "aivedio-admin-api")
    return LambdaHttpServer((host, port), load_handler(API_HANDLER), function_name="aivedio-api",
                            reuse_port=reuse_port, mounts=(admin,))
