"""Patterns: the grammar (``spec``), the lowering of a Spec to a KernelPlan (``lowering``) and the
float64 dense reference every kernel is judged against (``reference``)."""
