"""``nalar bench``: a load-testing client for any OpenAI-compatible server.

Modules: :mod:`bench.workloads` (what to send), :mod:`bench.arrival` (when),
:mod:`bench.client` (one streamed request, measured), :mod:`bench.sse` (the event-stream
framing), :mod:`bench.runner` (the load generator and the Python API, :func:`run_benchmark`),
:mod:`bench.stats` (the summary's definitions), :mod:`bench.report` and :mod:`bench.plot`
(JSON, text and PNG output), :mod:`bench.cli` (the command line).
"""
