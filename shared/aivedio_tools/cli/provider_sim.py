"""`aivedio provider-sim --port P [--config FILE] [--provider NAME] [--time-scale X]`: one provider
simulator in the foreground, for the provider named (default: the config's first). Its address goes
to stderr; Ctrl-C stops it."""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from aivedio.config import ConfigError, load_config, settings_from_env
from aivedio_tools.provider_sim import SimulatorServer


def _provider_sim(args: argparse.Namespace) -> int:
    settings = settings_from_env()
    config = load_config(args.config or settings.config_file)
    provider = config.provider(args.provider) if args.provider else config.providers[0]
    if provider is None:
        names = ", ".join(p.name for p in config.providers)
        raise ConfigError(f"--provider: no provider {args.provider!r} in the config (it has {names})")
    time_scale = args.time_scale if args.time_scale is not None else config.time_scale
    if time_scale <= 0:
        raise ConfigError("--time-scale: must be > 0")
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    sim = SimulatorServer(provider, provider.simulator, time_scale, port=args.port, host=args.host)
    try:
        try:
            sim.start()
        except OSError as e:
            raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        accounts = ", ".join(f"{a.account_id} (max {a.max_concurrency})" for a in provider.accounts)
        sys.stderr.write(f"provider simulator {provider.name} listening on {sim.base_url} (time_scale={time_scale:g})\n"
                         f"  accounts  {accounts}\n  truth     curl {sim.base_url}/_truth\nCtrl-C stops it.\n")
        sys.stderr.flush()
        while not stop.wait(0.5):
            pass
    finally:
        sim.stop()
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


def register(sub) -> None:
    p = sub.add_parser("provider-sim", help="run a provider simulator (docs/provider-protocol.md)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--config", default=None, help="the platform config whose provider entry to simulate (default: AIVEDIO_CONFIG)")
    p.add_argument("--provider", default=None, help="the provider entry to simulate (default: the first)")
    p.add_argument("--time-scale", type=float, default=None, help="overrides the config's time_scale")
    p.set_defaults(fn=_provider_sim)
