"""The distributions `pip install <wheel>` (no extras) would install, taken from this
environment instead of the index: the closure of the wheel's Requires-Dist, extras of the
dependencies followed (ray[serve]), markers evaluated here. link_into puts their recorded files
(RECORD: packages, byte code, dist-info, console scripts) into a fresh venv as hard links, so a
venv holds exactly that closure in a second or two, where pip spends ~280 s of CPU unpacking
and byte-compiling torch and ray again. The versions are the ones this environment resolved
from the same index for the same requirements.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        (meta,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(archive.read(meta).decode())
    return [Requirement(line) for line in message.get_all("Requires-Dist") or ()]


def _applies(requirement: Requirement, extra: str) -> bool:
    if requirement.marker is None:
        return extra == ""  # a base requirement: taken once, with the distribution itself
    return requirement.marker.evaluate({"extra": extra})


def dependency_closure(requirements: list[Requirement]) -> list[metadata.Distribution]:
    """The installed distributions `requirements` (a no-extras install's) pull in, transitively.
    Raises when one is missing here or its installed version does not satisfy a requirement:
    then this environment cannot stand in for the index."""
    found: dict[str, metadata.Distribution] = {}
    followed: set[tuple[str, str]] = set()
    pending = [r for r in requirements if _applies(r, "")]
    while pending:
        requirement = pending.pop()
        key = canonicalize_name(requirement.name)
        if key not in found:
            found[key] = metadata.distribution(requirement.name)
        dist = found[key]
        if not requirement.specifier.contains(dist.version, prereleases=True):
            raise RuntimeError(f"{requirement} is required; this environment has {dist.version}")
        for extra in ("", *sorted(requirement.extras)):
            if (key, extra) in followed:
                continue
            followed.add((key, extra))
            pending.extend(r for r in map(Requirement, dist.requires or ()) if _applies(r, extra))
    return list(found.values())


def link_into(dists: list[metadata.Distribution], site_packages: Path, python: Path) -> None:
    """Each distribution's RECORD files under `site_packages` (a venv's), hard links where the
    filesystem allows; console scripts are copied with `python` (the venv's) as their interpreter."""
    venv_root = python.parent.parent.resolve()
    for dist in dists:
        if dist.files is None:
            raise RuntimeError(f"{dist.metadata['Name']} has no RECORD: it cannot be copied file by file")
        for recorded in dist.files:
            source = Path(dist.locate_file(recorded))
            target = Path(os.path.normpath(site_packages / recorded))
            if not source.is_file() or not target.is_relative_to(venv_root) or target.exists():
                # RECORD lists files some installers never wrote; nothing lands outside the venv;
                # namespace packages' __init__.py belong to each of their distributions.
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.parent.name == "bin" and _is_script(source):
                _copy_script(source, target, python)
                continue
            try:
                os.link(source, target)
            except OSError:  # another filesystem
                shutil.copy2(source, target)


def _is_script(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(2) == b"#!"


def _copy_script(source: Path, target: Path, python: Path) -> None:
    _, _, body = source.read_bytes().partition(b"\n")
    target.write_bytes(b"#!" + str(python).encode() + b"\n" + body)
    target.chmod(0o755)
