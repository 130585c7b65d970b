"""Fixes: one planner per rule family turns findings into node-keyed edits; the codemod applies them.

In: a file's findings and its analysis. Out: the rewritten source (sum and count, one division
by the window's total), written atomically, or a refusal that says why.
"""
