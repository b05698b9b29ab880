"""The package's environment variables, all read one way.

On/off switches take 1/true/yes/on and 0/false/no/off in any case; counts take whole numbers;
choices take their names in any case. Unset or empty means the default. A value that is none of
these means the default too, with one warning per variable and value that names the variable
(a typo in a job's environment should not fail every call, nor pass unnoticed). Plain Python:
no import from the package.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()


def _value(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _ignored(name: str, value: str, expected: str, default: object) -> None:
    with _WARNED_LOCK:
        if (name, value) in _WARNED:
            return
        _WARNED.add((name, value))
    warnings.warn(f"torch_triton_gemm: {name}={value!r} is not {expected}; using the default "
                  f"({default!r})", RuntimeWarning, stacklevel=3)


def flag(name: str, default: bool) -> bool:
    """An on/off switch."""
    value = _value(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    _ignored(name, value, "one of 1/true/yes/on or 0/false/no/off", default)
    return default


def integer(name: str, default: int, least: int) -> int:
    """A whole number of at least ``least``."""
    value = _value(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        _ignored(name, value, f"a whole number of at least {least}", default)
        return default
    return number


def choice(name: str, choices: Mapping[str, str], default: str) -> str:
    """One of ``choices``' keys (any case), read as its value."""
    value = _value(name)
    if value is None:
        return default
    chosen = choices.get(value.lower())
    if chosen is None:
        _ignored(name, value, f"one of {', '.join(choices)}", default)
        return default
    return chosen
