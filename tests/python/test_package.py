"""Package surface: version, library info, struct layout, library lookup."""

import ctypes
import os
import re
import subprocess
import sys

import lmloss
from lmloss import _lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_info():
    cmake = open(os.path.join(REPO, "CMakeLists.txt")).read()
    assert re.search(r"project\(lmloss VERSION ([0-9.]+)", cmake).group(1) == lmloss.__version__
    assert isinstance(lmloss.has_cuda(), bool)
    assert lmloss.cpu_isa() in ("avx512", "avx2", "portable")
    assert issubclass(lmloss.Error, ValueError)


def test_struct_layout():
    """Sizes and offsets of include/lmloss.h on LP64 (checked with gcc)."""
    off = lambda s, f: getattr(s, f).offset  # noqa: E731
    assert ctypes.sizeof(_lib.Tensor) == 40 and off(_lib.Tensor, "rows") == 16
    assert ctypes.sizeof(_lib.Context) == 24 and off(_lib.Context, "num_threads") == 16
    assert ctypes.sizeof(_lib.Transform) == 12
    o = _lib.CEOptions
    assert ctypes.sizeof(o) == 56
    assert [off(o, f) for f in ("label_smoothing", "transform", "reduction", "num_items", "dft",
                                "grad_output", "zero_ignored_rows")] == [8, 16, 28, 32, 40, 44,
                                                                         48]
    assert ctypes.sizeof(_lib.CEInputs) == 160 and ctypes.sizeof(_lib.CEOutputs) == 200
    d = _lib.ce_options_default()
    assert (d.ignore_index, d.reduction, d.grad_output, d.zero_ignored_rows) == (-100, 2, 1.0, 1)


def test_library_from_env(tmp_path):
    """LMLOSS_LIBRARY comes first; a wrong path is not silently skipped."""
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(lmloss.__file__)))
    code = "import lmloss; print(lmloss.library_path)"

    def run(lib):
        env = dict(os.environ, LMLOSS_LIBRARY=lib, PYTHONPATH=pkg_parent)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, cwd=tmp_path)

    out = run(lmloss.library_path)
    assert out.returncode == 0 and out.stdout.strip() == lmloss.library_path
    out = run(str(tmp_path / "missing.so"))
    assert out.returncode != 0 and "missing.so" in out.stderr


def _public_functions():
    """(qualified name, function) of every public function and method of
    lmloss, lmloss.torch and the drop-ins (those importable here)."""
    import importlib
    import inspect
    names = ["lmloss"]
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        names += ["lmloss.torch", "lmloss.integrations.transformers",
                  "lmloss.integrations.trl"]
    except ImportError:
        pass
    for modname in names:
        mod = importlib.import_module(modname)
        public = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
        for name in public:
            obj = getattr(mod, name)
            if inspect.isfunction(obj) and obj.__module__.startswith("lmloss"):
                yield "%s.%s" % (modname, name), obj
            elif inspect.isclass(obj) and obj.__module__.startswith("lmloss"):
                for mname, m in vars(obj).items():
                    m = getattr(m, "__func__", m)
                    if inspect.isfunction(m) and (not mname.startswith("_")
                                                  or mname == "__init__"):
                        yield "%s.%s.%s" % (modname, name, mname), m


def test_type_hints_and_py_typed():
    """Every public function is annotated (its parameters and its return)
    and documented, and the package ships the py.typed marker (PEP 561)."""
    import inspect
    assert os.path.isfile(os.path.join(os.path.dirname(lmloss.__file__), "py.typed"))
    missing, seen = [], 0
    for qual, fn in _public_functions():
        seen += 1
        sig = inspect.signature(fn)
        for p in sig.parameters.values():
            if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty:
                missing.append("%s(%s)" % (qual, p.name))
        if sig.return_annotation is inspect.Signature.empty:
            missing.append("%s -> ?" % qual)
        if not (fn.__doc__ or "").strip() and not qual.endswith(("__init__", "forward")):
            missing.append("%s: no docstring" % qual)
    # the NumPy API alone has 14 (lmloss.torch adds its own where torch is installed)
    assert seen >= 14 and not missing, missing
