"""`python -m aivedio_tools.cli`: the `aivedio` command, for an environment without its console script."""
from aivedio_tools.cli import main

raise SystemExit(main())
