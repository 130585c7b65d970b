"""gaaudit: find, fix and prove the gradient-accumulation loss bug."""

__version__ = "0.1.0"
