"""Test only: on SIGUSR2, block rsagg's event loop (a blocking call on the trio thread, the bug the
watchdog is there for). The other threads go on; only the loop's WATCHDOG=1 pings stop."""

from __future__ import annotations

import signal
import threading
import time

from aggregator.plugin_api import hookimpl


def _hang(signum: int, frame: object) -> None:
    time.sleep(3600)


@hookimpl
def rsagg_startup(plugin, config):
    # Python runs signal handlers on the main thread, which is trio's: the handler blocks the loop.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR2, _hang)
