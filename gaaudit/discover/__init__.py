"""Discover: which files to read and which of their parts can matter, before any libcst.

In: the paths a command was given. Out: source text (notebooks joined into one module), the
definitions the byte and `ast` screens keep, and the repository files a file depends on.
"""
