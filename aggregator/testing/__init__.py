"""Test doubles, like ``trio.testing``: a programmable ResourceSync Source and its notifier.

``Upstream`` (``upstream.py``) is a Source the test suite controls completely — its change history,
timing, index splitting and faults — served over real HTTP on loopback; ``UpstreamNotifier``
(``notify.py``) gives it Change and Framework Notification channels over a real WebSub hub. Plugin
authors can use them in their own tests. Runtime code never imports this package; only the
``rsagg demo`` command does (a test enforces it).
"""

from .notify import UpstreamNotifier
from .upstream import PATCH_TYPE, ChangeRecord, StepClock, Upstream, canonical_json

__all__ = ["PATCH_TYPE", "ChangeRecord", "StepClock", "Upstream", "UpstreamNotifier", "canonical_json"]
