"""What a lent GPU machine lacks for gpu_check, and fetching it as wheels to carry there.

The device's image has torch, triton, transformers, safetensors, tokenizers and numpy, but not
msgspec (splitserve's wire messages) or pydantic (its configs), and nothing can be installed
there from the network. `python bench/gpu_check/device_wheels.py .whl` downloads them, at the
versions installed here, as CPython 3.12 manylinux wheels into .whl/ (ignored by git); the device
command installs them with `pip install --no-index --target` (bench/README.md has the command).
tests/bench/test_gpu_check.py runs the CPU dry run importing nothing else from outside the
standard library, so a new import the device lacks fails CI, not a device run."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

# Distributions to carry: splitserve's imports the device lacks, and what they pin.
CARRIED = ("msgspec", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")
# Top-level modules gpu_check may import from the device's own image.
DEVICE_IMAGE_MODULES = ("torch", "triton", "transformers", "safetensors", "tokenizers", "numpy", "peft")
# The import names of CARRIED.
CARRIED_MODULES = ("msgspec", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def download(dest: Path) -> list[Path]:
    """Each CARRIED distribution, at its installed version, as a cp312 wheel into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in CARRIED:
        version = importlib.metadata.version(name)
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        command += ["--python-version", "3.12", "--implementation", "cp", "-d", str(dest), f"{name}=={version}"]
        for platform in PLATFORMS:
            command += ["--platform", platform]
        subprocess.run(command, check=True, timeout=600)
    return sorted(dest.glob("*.whl"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/gpu_check/device_wheels.py DEST_DIR")
    for wheel in download(Path(sys.argv[1])):
        print(wheel)
