"""Structured output: grammars (JSON schema, regex, choice, EBNF) that constrain which tokens may be sampled.

The frontend validates a request's spec (params.py, backend_xgrammar.validate_structured_outputs); the engine
core compiles it off the busy loop (manager.py), fills each step's token bitmask for the requests that sample,
and advances each request's matcher with the tokens it accepts.
"""
