"""``import swiftkv`` makes transformers' Auto classes know the SwiftKV model types, so that
``import swiftkv`` then ``AutoModelForCausalLM.from_pretrained(swiftkv_checkpoint)`` works as for
any Hugging Face model, whichever of the two is imported first.

Registering needs the model classes, so torch and transformers (seconds to import), while ``import
swiftkv`` must stay light (the ``swiftkv`` command answers ``--help`` at once). So the registration
(importing ``swiftkv.modeling``) waits for the program to use the Auto classes: it runs as soon as
transformers' ``configuration_auto`` is loaded and no transformers import is under way. Not earlier:
transformers loads ``configuration_auto`` from inside other imports (``modeling_utils`` does, while
``modeling_llama`` is half loaded), and ``swiftkv.modeling`` needs those modules whole.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Sequence
from importlib.abc import Loader
from importlib.machinery import ModuleSpec
from types import ModuleType

CONFIGURATION_AUTO = "transformers.models.auto.configuration_auto"


def register() -> None:
    """Register the SwiftKV types with ``AutoConfig`` and ``AutoModelForCausalLM`` now."""
    importlib.import_module("swiftkv.modeling")  # registers on import


class _ThenRegister:
    """A transformers module's own loader, counting the transformers imports under way in this
    thread; when the outermost one is done and the Auto classes are loaded, it registers."""

    under_way = threading.local()

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        depth = getattr(self.under_way, "depth", 0)
        self.under_way.depth = depth + 1
        try:
            self.loader.exec_module(module)
        finally:
            self.under_way.depth = depth
        if depth == 0 and CONFIGURATION_AUTO in sys.modules and _WATCH in sys.meta_path:
            sys.meta_path.remove(_WATCH)
            register()

    def __getattr__(self, name: str):  # get_source, get_resource_reader, ...: the module's own loader's
        return getattr(self.loader, name)


class _Watch:
    """Finds transformers' modules as the other finders do, giving each a :class:`_ThenRegister` loader."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name != "transformers" and not name.startswith("transformers."):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenRegister(spec.loader)
                return spec
        return None


_WATCH = _Watch()


def register_when_used() -> None:
    """Register now if the program already uses transformers' Auto classes, else as soon as it does."""
    if CONFIGURATION_AUTO in sys.modules:
        register()
    elif _WATCH not in sys.meta_path:
        sys.meta_path.insert(0, _WATCH)
