"""The live cluster dashboard served by the ingress at ``GET /dashboard``.

A static page (``static/``: HTML, vanilla JavaScript drawing plain SVG, CSS; nothing fetched
from elsewhere) polls ``GET /dashboard/data`` every 1.5 s; :class:`Dashboard` assembles that
document from the workers' stats, the router's telemetry, the digest index and the ingress's
own latency rings.
"""

from cluster.dashboard.routes import dashboard_router
from cluster.dashboard.state import Dashboard

__all__ = ["Dashboard", "dashboard_router"]
