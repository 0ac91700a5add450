"""Names kept for one release after a rename, each warning (FutureWarning, shown by default) with the
name that replaces it. A module lists its old names in a dict {old: (new spelling, getter)} and
forwards its __getattr__ here."""

import warnings


def warn(old, new, stacklevel=3):
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", FutureWarning,
                  stacklevel=stacklevel)


def module_getattr(module_name, renamed, name):
    """A module's __getattr__ (PEP 562) over `renamed`: the new object, after a warning naming it."""
    if name in renamed:
        new, get = renamed[name]
        warn(f"{module_name}.{name}", new, stacklevel=4)  # this frame, the module's __getattr__, then the caller
        return get()
    raise AttributeError(f"module '{module_name}' has no attribute '{name}'")
