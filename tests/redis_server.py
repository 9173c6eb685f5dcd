"""The private redis-server lives in aivedio_tools.chaos.redis_server (the chaos runner needs one it can
kill and restart); this re-export keeps the tests that import it from here working."""
from aivedio_tools.chaos.redis_server import *  # noqa: F401,F403
from aivedio_tools.chaos.redis_server import RedisServer, free_port, redis_server_binary  # noqa: F401
