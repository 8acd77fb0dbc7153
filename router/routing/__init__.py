"""Request routing for the worker deployment: a Ray Serve ``RequestRouter`` and its Ray-free parts.

Modules: :mod:`~router.routing.request_input` (what routing reads from a request),
:mod:`~router.routing.replica_stats` (what it reads from a replica's routing stats),
:mod:`~router.routing.policies` (the scoring policy), :mod:`~router.routing.ledger` (work sent
and not yet reported) and :mod:`~router.routing.ray_router` (the Ray Serve glue).
"""
