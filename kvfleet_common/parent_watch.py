"""A service started by a local cluster (`kvfleet up`, LocalCluster) stops once the process that
started it is gone, however it went (a SIGKILL, a crash), instead of holding its port and memory
as an orphan.

The starter names itself in KVFLEET_PARENT_PID. A daemon thread looks at this process's parent
once a second; when it has changed (the orphan was handed to init or a subreaper), the thread
sends this process its own SIGTERM, which every service already answers by draining and exiting.
Without the variable (docker-compose, a service started by hand) nothing is watched.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

PARENT_PID_ENV = "KVFLEET_PARENT_PID"
CHECK_S = 1.0


def exit_with_parent(env: Mapping[str, str] | None = None, interval_s: float = CHECK_S) -> threading.Thread | None:
    """Watch the parent named in the environment (see the module docstring); returns the watching
    thread, or None when nothing is watched (no variable, or one that does not name the parent)."""
    raw = (os.environ if env is None else env).get(PARENT_PID_ENV, "").strip()
    if not raw:
        return None
    try:
        pid = int(raw)
    except ValueError:
        log.warning("%s=%r is not a process id: not watching the parent", PARENT_PID_ENV, raw)
        return None
    if os.getppid() != pid:  # inherited by something the cluster did not start itself
        log.warning("%s=%d is not this process's parent (%d): not watching it", PARENT_PID_ENV, pid, os.getppid())
        return None

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(interval_s)
        log.warning("the process that started this one (pid %d) is gone: stopping", pid)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
