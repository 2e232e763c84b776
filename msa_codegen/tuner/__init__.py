"""The former home of the tuner, kept only for its command line: ``python -m msa_codegen.tuner.grid``.

Everything else lives in ``msa_codegen.tuning`` (search, measure, space, grid, auto).
"""
