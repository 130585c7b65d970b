"""Analysis: one parsed file read as a training loop, shared by check, fix and verify.

In: a libcst module from `discover`. Out: the tree's indexes and positions, the accumulation
windows (backward, step, divisor), where each loss comes from and what its mean counts.
"""
