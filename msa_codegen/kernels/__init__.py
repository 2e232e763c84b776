"""The kernels: what a call launches and how.

    render.py    templates (msa_codegen/templates/) -> Triton source on disk -> loaded module
    schedule.py  tile and band arithmetic: grids, head dims, the backward's scratch and prefix chunks
    tma.py       when operands go through tensor descriptors (TMA), and the switch tests use
    launch.py    the forward and backward launchers (allocation, strides, one launch per head group)
"""
