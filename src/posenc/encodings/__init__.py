"""Built-in encodings, one family per module; importing this package registers them all.

Every module in this package is imported, so a new family only needs its own file.
"""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
