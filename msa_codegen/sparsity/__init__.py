"""Run-time sparsity: the inputs chosen from the data (``inputs``: documents, positions, buckets,
top-k block ids), the block tables of random and top-k terms (``tables``) and the helpers that
compute inputs (``selection``: ``select_blocks``, ``hash_sort``)."""
