"""Request routing for the worker deployment: a Ray Serve ``RequestRouter`` and its Ray-free parts.

Modules: :mod:`~router.routing.request_input` (what routing reads from a request, and its work
in tokens; a replica's load report is :class:`contract.load.RoutingStats`),
:mod:`~router.routing.policies` (prefix, round-robin, power-of-two),
:mod:`~router.routing.ledger` (work sent and not yet reported), :mod:`~router.routing.index_lookup`
(the bounded digest index query), :mod:`~router.routing.sent_prefixes` (the prompt prefixes this
router sent to each worker: its fallback while the index is down or late),
:mod:`~router.routing.telemetry` (decisions and index health for ``/metrics`` and the dashboard),
:mod:`~router.routing.replica_keys` (the replicas' model keys, for the ingress),
:mod:`~router.routing.finished_requests` (the ingress's word that a request finished, for the
routers) and :mod:`~router.routing.ray_router` (the Ray Serve glue).
"""
