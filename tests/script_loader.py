"""Import a script of the repository (an experiment's driver, a benchmark, an example) as a module, by its path."""
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str, path: str) -> ModuleType:
    """The file ``ROOT / path`` as the module ``name`` (registered in ``sys.modules``, where dataclasses look
    their module up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
