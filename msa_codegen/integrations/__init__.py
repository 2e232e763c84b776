"""Integrations of msa_codegen with other libraries.

Each submodule imports its library lazily, so importing ``msa_codegen`` (or this package) never
imports them. ``msa_codegen.integrations.transformers``: ``attn_implementation="msa"`` for
Hugging Face transformers models.
"""
