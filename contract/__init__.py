"""The wire contract: the types that cross process boundaries between the ingress, the router
and the workers, which all three import and none owns.

* :mod:`contract.request`: the generation request, its sampling parameters, and the chunks a
  worker streams back;
* :mod:`contract.identity`: the cache identity and the chained block digests of a prompt;
* :mod:`contract.kv_events`: the KV events a worker publishes to the digest index (msgpack);
* :mod:`contract.load`: the load unit (tokens of work) and a worker's routing stats;
* :mod:`contract.description`: what a worker tells the ingress about itself (``describe()``).
"""
