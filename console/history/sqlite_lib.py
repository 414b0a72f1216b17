"""sqlite-utils, imported when first asked for (:func:`load`) and without its optional pandas and numpy support.

Importing sqlite-utils costs more than the rest of a CLI call's imports together (its ``db`` module: about 0.14 s of
``python -X importtime`` on the 2-core test machine), and the console needs it only to create or migrate the
history's schema; so nothing imports it at module level, and a history whose schema is current never loads it
(:func:`gpudeck.console.history.replica.schema_current`).

sqlite-utils imports pandas and numpy at import time when they are installed, only
to map their scalar types to SQLite column types. gpudeck never hands it a
DataFrame or a numpy value (every row is built from msgspec-decoded events), and
on a host that has them — the ``train`` extra brings pandas through ``datasets`` —
the two imports cost about 0.35 s of every CLI call (``python -X importtime -c
"import gpudeck.console.cli.main"``: 600-790 ms with them, 270-310 ms without, on the
2-core test machine). So they are hidden for the duration of this one import and
only when nothing has imported them yet; the entries are removed afterwards, so
a later ``import pandas`` in the same process works as usual. Nothing inside
sqlite-utils is changed: it sees what it would see on a host without pandas.
"""

from __future__ import annotations

import sys
from types import ModuleType

__all__ = ["load"]

_OPTIONAL = ("pandas", "numpy")


def load() -> ModuleType:
    """The sqlite_utils module (imported on the first call; pandas and numpy kept out as above)."""
    loaded = sys.modules.get("sqlite_utils")
    if loaded is not None:
        return loaded
    hidden = [name for name in _OPTIONAL if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError while this holds
    try:
        import sqlite_utils
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    return sqlite_utils
