"""WebSub, both ways, in one package (W3C WebSub Recommendation; ResourceSync Notification 1.0).

- ``hub.py`` — the embedded hub: subscriptions, verification of intent, signed and retried delivery;
- ``notifier.py`` — rsagg's own Change and Framework Notification channels (the publisher side);
- ``subscriber.py`` — subscriptions to upstream channels and what their notifications trigger;
- ``service.py`` — the three as one (``Notifications``, ``run_notifications``), built by the composition.

Retries and backoff of all three come from ``aggregator.net.retry``; their state calls run one at a time
in a worker thread (``store/calls.py`` ``StoreCalls``). Importing this package imports only
the wiring; the parts are imported when notifications are on.
"""

from .service import Notifications, app_options, run_notifications

__all__ = ["Notifications", "app_options", "run_notifications"]
