"""A local `redis-server` process for tests and `rollstream dev up`.

Persistence is off by default (`--save "" --appendonly no`): `kill()` or `restart()` loses every
key, exactly as a production Redis without persistence does when it crashes. Fault tests use this
to prove that the pipeline survives losing its Redis state. Pass `appendonly=True` for the
persistence the project deploys (compose.yaml: `--appendonly yes`, Redis's default
`appendfsync everysec`): a clean stop keeps every key, a crash (`kill()`) may lose the last
second of writes, as in production. `snapshot()` saves an RDB file of this moment and
`restore(snapshot)` crashes the server and starts it again from that file: Redis coming back
with the state of an earlier moment. The port never changes across restarts.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from urllib.parse import quote

from rollstream.dev.processes import LOCALHOST, LocalServer, MissingToolError

logger = logging.getLogger(__name__)


class RedisStartError(RuntimeError):
    """redis-server did not answer PING; the message ends with the last lines of its log."""


def redis_server_executable() -> str:
    """Path of `redis-server`; raises MissingToolError with the install hint when absent."""
    found = shutil.which("redis-server")
    if found is None:
        raise MissingToolError(
            "redis-server not found: install it with `apt-get install redis-server`, "
            "or set REDIS_URL to use an existing Redis"
        )
    return found


class LocalRedisServer(LocalServer):
    """One redis-server on 127.0.0.1 with its working files and log under `workdir`."""

    START_TIMEOUT = 30.0
    STOP_TIMEOUT = 10.0  # redis exits promptly on SIGTERM
    START_ERROR = RedisStartError

    def __init__(
        self,
        workdir: Path,
        password: str | None = None,
        appendonly: bool = False,
        detached: bool = False,
    ) -> None:
        super().__init__(workdir, "redis-server", "redis.log", detached)
        self.password = password
        self.appendonly = appendonly
        self.snapshots = 0
        self._from_rdb = False  # the next start loads dump.rdb (restore), then turns AOF on

    @property
    def url(self) -> str:
        """redis://127.0.0.1:PORT/0, with the password as redis://:PASS@... when one is set."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{LOCALHOST}:{self.port}/0"

    def start(self, timeout: float | None = None) -> str:
        """Start redis-server and block until it answers PING; return `url`."""
        began = time.monotonic()
        self._process.start(self._argv(), cwd=self.workdir)  # creates workdir (the log's directory)
        self._await_ready(self._answers_ping, began, timeout, 0.05, "redis-server", "did not answer PING in time")
        if self._from_rdb:
            self._from_rdb = False
            if self.appendonly:  # loaded from the RDB file; from now on the AOF, as deployed
                self._client().config_set("appendonly", "yes")
        logger.info("redis-server ready on port %d in %.2fs", self.port, self.startup_seconds)
        return self.url

    def snapshot(self) -> Path:
        """Save this moment's keys as an RDB file (SAVE: what a snapshot holds) and return a
        copy of it, for :meth:`restore`."""
        with self._client() as client:
            client.save()
        self.snapshots += 1
        copy = self.workdir / "snapshots" / f"{self.snapshots}.rdb"
        copy.parent.mkdir(exist_ok=True)
        shutil.copyfile(self.workdir / "dump.rdb", copy)
        return copy

    def restore(self, snapshot: Path, timeout: float | None = None) -> str:
        """Crash the server (SIGKILL) and start it again with the keys of ``snapshot`` (a new
        redis-server process that loaded an older RDB file, as after a restart from the last
        snapshot or a failover to a replica that lagged); return `url`."""
        self.kill()
        shutil.rmtree(self.workdir / "appendonlydir", ignore_errors=True)
        shutil.copyfile(snapshot, self.workdir / "dump.rdb")
        self._from_rdb = True
        return self.start(timeout)

    def _client(self, timeout: float = 10.0):  # type: ignore[no-untyped-def]
        import redis  # the client library is a project dependency; only needed here

        return redis.Redis.from_url(self.url, socket_timeout=timeout, socket_connect_timeout=min(timeout, 2.0))

    def _argv(self) -> list[str]:
        aof = self.appendonly and not self._from_rdb  # a start from an RDB file turns AOF on once loaded
        argv = [
            redis_server_executable(),
            "--port", str(self.port),
            "--bind", LOCALHOST,
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "yes" if aof else "no",
            "--logfile", "",
        ]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv

    def _answers_ping(self) -> bool:
        import redis

        with self._client(1.0) as client:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False
