"""Packaging: the design card's top-level folders install under one name, `splitserve.*`.

engine/ is installed as splitserve.engine, cluster/ as splitserve.cluster, and so on, so no
top-level `engine`, `cluster`, `proto` or `bench` lands in site-packages (proto-plus owns
`proto`). The gRPC stubs are generated from proto/splitserve.proto while the wheel is built.
"""

import importlib.util
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
TOP_LEVEL = ("engine", "runtime", "prefill", "decode", "kvtransfer", "cluster", "proto", "bench")

packages, package_dir = [], {}
for top in TOP_LEVEL:
    package_dir[f"splitserve.{top}"] = top
    packages += [f"splitserve.{top}"] + [f"splitserve.{top}.{sub}" for sub in find_packages(top)]


class BuildPyWithStubs(build_py):
    """Generate the gRPC stubs into the build tree (they are never committed)."""

    def run(self):
        super().run()
        spec = importlib.util.spec_from_file_location("_proto_build", ROOT / "proto" / "build.py")
        proto_build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(proto_build)
        if getattr(self, "editable_mode", False):
            proto_build.build()  # next to the .proto, where the editable install imports them
        else:
            out_dir = Path(self.build_lib) / "splitserve" / "proto"
            out_dir.mkdir(parents=True, exist_ok=True)
            proto_build.build(out_dir=out_dir)


setup(packages=packages, package_dir=package_dir, cmdclass={"build_py": BuildPyWithStubs})
