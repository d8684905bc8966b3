"""A throwaway PostgreSQL server for tests: Debian's own binaries, a new cluster in a
temporary folder, on a free loopback port, without sync to disk (nothing in it outlives
the test run). PostgreSQL refuses to run as root: as root, it runs as the `postgres` user
that Debian's package creates. `.ci/run` installs that package when it is missing.

    with Postgres() as pg:        # None of this if no server binaries are installed
        url = pg.new_database()   # postgresql://postgres@127.0.0.1:PORT/NAME
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from tools.chainlit_client import free_port


def binaries() -> Path | None:
    """The newest installed server's folder (Debian: /usr/lib/postgresql/N/bin)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit()
                   else 0)
    return found[-1].parent if found else None


class Postgres:
    def __init__(self):
        self.bin = binaries()
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="vchat-pg-"))
        self.data = self.folder / "data"
        self._as = []
        if os.geteuid() == 0:  # initdb and postgres refuse root
            account = pwd.getpwnam("postgres")
            os.chown(self.folder, account.pw_uid, account.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    def _run(self, *command: str) -> None:
        done = subprocess.run([*self._as, *command], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {done.stdout}{done.stderr}")

    def __enter__(self) -> "Postgres":
        if self.bin is None:
            raise FileNotFoundError("no PostgreSQL server installed (Debian: postgresql)")
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                  "--auth=trust", "-E", "UTF8", "--no-sync")
        self.start()
        return self

    def start(self) -> None:
        """The server up (again), on its port; returns once it takes connections."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-l",
                  str(self.folder / "server.log"), "-o",
                  f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 "
                  "-c fsync=off -c synchronous_commit=off -c full_page_writes=off", "start")

    def stop(self) -> None:
        """The server down as an operator's restart takes it down (`fast`: sessions ended,
        what they committed kept)."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def __exit__(self, *exc) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                      "-w", "stop")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """An empty database of its own; its URL."""
        name = "t" + uuid.uuid4().hex[:12]
        self._run(str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U",
                  "postgres", "-q", "-c", f"CREATE DATABASE {name}")
        return self.url(name)
