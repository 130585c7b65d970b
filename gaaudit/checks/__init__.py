"""Checks: the rules' code, one module per family (accumulation, trainer, optax, versions,
windows); `context.run` applies them all to one parsed file.

In: a file's analysis. Out: findings with their confidence and evidence. `engine` runs the
whole pipeline (discover, parse, analyse, check) for one file, or many through the cache.

A new rule goes in the module of its family (or a new module listed in `context.CHECKERS`),
with its catalogue entry in `rules/<CODE>.toml` and fixtures under `fixtures/`.
"""
