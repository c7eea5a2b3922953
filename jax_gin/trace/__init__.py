"""`python -m jax_gin.trace merge a.json b.json -o all.json` (jax_gin/_trace.py).

Importing this subpackage (`import jax_gin.trace`) makes it the package's attribute `trace`,
in place of the context manager jax_gin.trace(path); so the module is callable as that
context manager, and `with jax_gin.trace(path):` and `jax_gin.trace.dump(path)` work either
way."""
import sys
import types

from jax_gin._trace import trace as _trace


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _trace(*args, **kwargs)


dump = _trace.dump
sys.modules[__name__].__class__ = _CallableModule
