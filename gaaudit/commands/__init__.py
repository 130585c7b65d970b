"""Commands: one run of check, fix, verify or init without the CLI library, and the flake8 plugin.

In: options from `gaaudit.cli` (or flake8). Out: reports, rewritten files and an exit status.
Nothing here is imported at package level, so a pre-commit `check` loads only what it uses.
"""
