"""The TOML reader every recipe goes through: the standard library's ``tomllib`` (Python 3.11+), or
``tomli``, the package it was taken from, on Python 3.10 (pyproject.toml installs it there)."""

try:
    import tomllib  # novermin (tomli below on 3.10)
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["tomllib"]
