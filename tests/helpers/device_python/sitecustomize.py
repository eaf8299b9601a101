"""Makes this interpreter look like the lent GPU machine's to splitserve's own code (put this
folder on PYTHONPATH): no installed splitserve (gpu_check maps the repository itself), and an
import from a project file of any module outside the standard library and
SPLITSERVE_DEVICE_MODULES fails as it would there. Third-party code imports what it likes (the
device has its own versions of those libraries' needs)."""

import importlib.abc
import os
import sys

_ROOT = os.environ["SPLITSERVE_DEVICE_ROOT"].rstrip("/") + "/"
_ALLOWED = set(os.environ["SPLITSERVE_DEVICE_MODULES"].split(",")) | set(sys.stdlib_module_names)


def _imported_from_project() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "importlib" in filename or filename.startswith("<frozen") or filename == __file__:
            frame = frame.f_back
            continue
        return filename.startswith(_ROOT) and "/site-packages/" not in filename and "/.venv/" not in filename
    return False


class _DeviceImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in _ALLOWED and top not in ("splitserve", "tests") and _imported_from_project():
            raise ModuleNotFoundError(f"No module named {name!r} on the GPU machine (see device_wheels.py)", name=name)
        return None


sys.meta_path.insert(0, _DeviceImage())
# No installed splitserve there: drop the editable install's finder and path entry.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__ + repr(f)]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
