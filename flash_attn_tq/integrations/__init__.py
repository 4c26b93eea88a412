"""Integrations with model libraries (import the submodule you need, e.g. ``.transformers``)."""
