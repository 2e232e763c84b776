"""Command-line tools: ``msa-codegen`` (this package) and ``msa-bench`` (msa_codegen.bench)."""
