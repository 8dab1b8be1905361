"""The TOML reader every recipe goes through: the standard library's ``tomllib`` (Python 3.11+), or
``tomli``, the package it was taken from, on Python 3.10 (pyproject.toml installs it there)."""

from glmpost.errors import UsageError

try:
    import tomllib  # novermin (tomli below on 3.10)
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["load_recipe", "tomllib"]


def load_recipe(path) -> dict:
    """A TOML recipe as a dict; a missing, directory, malformed or not UTF-8 file is a one-line
    usage error naming it."""

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"recipe {path} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"recipe {path} is a directory, not a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"recipe {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"recipe {path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
