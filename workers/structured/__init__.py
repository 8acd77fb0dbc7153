"""Structured output: constrained decoding of JSON Schema, regex, choice and Lark grammar
constraints (``workers.structured.grammar``)."""
