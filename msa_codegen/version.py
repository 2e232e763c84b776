"""The library version (``msa_codegen.__version__``), in a module of its own so that the kernel
renderer and the tuning keys can name it without importing the package's public facade."""
__version__ = "0.1.0"
