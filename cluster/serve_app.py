"""The application builder that Ray Serve config files import.

``serve run k8s/serve-config.yaml`` locally, and KubeRay's RayService (its ``serveConfigV2``),
name ``cluster.serve_app:app_builder`` as the application's ``import_path`` and pass
:class:`~cluster.config.ClusterConfig`'s fields as ``args``; Serve validates them into that
model before calling the builder, so a config file and ``nalar serve`` flags reach the same
typed configuration and the same :func:`~cluster.app.build_app`.
"""

# No ``from __future__ import annotations``: Serve reads the builder's parameter annotation
# as a class to validate ``args`` into, and a string annotation would skip that validation.

from ray.serve.deployment import Application

from cluster.app import build_app
from cluster.config import ClusterConfig


def app_builder(args: ClusterConfig) -> Application:
    """The Nalar application for ``args`` (a config file's ``applications[].args``).

    A config-file deployment should name ``redis_url``: without it the index is the embedded
    Ray actor, created by the first worker that publishes, which lives only as long as that
    worker (fine on one machine, fragile across nodes).

    Raises:
        pydantic.ValidationError: (raised by Serve before this runs) an unknown or
            out-of-range argument.
    """
    return build_app(args)
