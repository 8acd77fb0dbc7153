"""The error of an adapter that cannot be served, in a module of its own so that the ingress
can tell it apart from other failures without importing the adapter loader (torch,
safetensors)."""


class AdapterError(ValueError):
    """An adapter that cannot be served on this base model; the message names the reason."""
