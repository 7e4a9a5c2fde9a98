"""Optional integrations with other libraries; each is active only when its library is installed.

`import capt` calls `register_when_loaded()`, so that `peft.get_peft_model(base, capt.CaptConfig())` and
`peft.PeftModel.from_pretrained(base, path)` work without further setup. PEFT imports torch, so the registration
waits until the program imports peft itself (or something of capt that needs it): `import capt` alone, and with
it `capt --help`, stays quick.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

from ..import_utils import missing_modules, peft_available


def register_available() -> None:
    """Register CaPT with every installed library that has a plugin mechanism (idempotent)."""
    if peft_available():
        from .peft import register

        register()


def register_when_loaded() -> None:
    """Register CaPT with PEFT now if peft is loaded, else as soon as it is (a hook on the import system).

    Example:
        >>> import sys, capt, peft
        >>> "capt.integrations.peft" in sys.modules  # importing peft registered CaPT
        True
    """
    if missing_modules("peft", "aenum"):
        return
    if "peft" in sys.modules:
        register_available()
    elif not any(isinstance(finder, _RegisterWhenLoaded) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenLoaded())


class _RegisterWhenLoaded(importlib.abc.MetaPathFinder):
    """Watches the imports of peft and of capt's modules, and registers CaPT once peft has loaded and no capt
    module is half-imported: the registration imports `capt.config` and `capt.model`, whose own import may be what
    imports peft (`CaptConfig` is a `PeftConfig`). The other finders find the modules; this one only wraps their
    loaders."""

    def __init__(self) -> None:
        self.capt_modules_loading = 0

    def find_spec(
        self, name: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "peft" and not name.startswith("capt."):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _WatchedLoader(spec.loader, self, is_capt=name != "peft")
        return spec

    def module_loaded(self) -> None:
        if self.capt_modules_loading == 0 and "peft" in sys.modules and self in sys.meta_path:
            sys.meta_path.remove(self)
            register_available()


class _WatchedLoader(importlib.abc.Loader):
    """A module's own loader, telling `_RegisterWhenLoaded` when the module has run (all else is the loader's)."""

    def __init__(self, loader: importlib.abc.Loader, watcher: _RegisterWhenLoaded, is_capt: bool) -> None:
        self._loader, self._watcher, self._is_capt = loader, watcher, is_capt

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._watcher.capt_modules_loading += self._is_capt
        try:
            self._loader.exec_module(module)
        finally:
            self._watcher.capt_modules_loading -= self._is_capt
        self._watcher.module_loaded()

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, is_package, ...
        return getattr(self._loader, name)
