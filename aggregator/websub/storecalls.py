"""Re-export for websub/notifier.py, which still imports ``StoreCalls`` from here: the helper is
``store/calls.py``'s. Drop this module once notifier.py imports it from ``..store.calls``."""

from ..store.calls import Closed, StoreCalls

__all__ = ["Closed", "StoreCalls"]
