"""A job's ``working_dir``: a directory of the user's code (a factory module) shipped
with the job. The CLI zips a local directory, the service stores it under
``<storage>/packages/<id>`` (the id names its content), and the runner hands that
directory to Ray's job API, which uploads it to the cluster as a package; or the spec
names a package Ray already has (``gcs://_ray_pkg_<hash>.zip`` and Ray's other URIs)."""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import zipfile

MAX_PACKAGE_BYTES = 64 << 20  # zipped; Ray's own limit for a working_dir is 500 MiB
MAX_FILES = 10_000
PACKAGE_ID = re.compile(r"^pkg-[0-9a-f]{32}$")
RAY_URI = re.compile(r"^(gcs|s3|gs|https|file)://\S+\.zip$")
SKIPPED = {".git", ".venv", "__pycache__", ".pytest_cache", "node_modules"}


class PackageError(ValueError):
    """An upload or a reference that cannot be used; the message says why."""


def zip_directory(path: str) -> bytes:
    """``path``'s files as a zip (version-control and build folders left out)."""
    if not os.path.isdir(path):
        raise PackageError(f"working_dir: {path!r} is not a directory")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED)
            for name in sorted(files):
                full = os.path.join(root, name)
                if os.path.isfile(full) and not os.path.islink(full):
                    zf.write(full, os.path.relpath(full, path))
    return out.getvalue()


def _safe_members(zf: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    members = zf.infolist()
    if len(members) > MAX_FILES:
        raise PackageError(f"working_dir: {len(members)} files; at most {MAX_FILES}")
    for info in members:
        parts = info.filename.replace("\\", "/").split("/")
        if info.filename.startswith("/") or ".." in parts:
            raise PackageError(f"working_dir: {info.filename!r} leads outside the package")
        if stat.S_ISLNK(info.external_attr >> 16):
            raise PackageError(f"working_dir: {info.filename!r} is a symbolic link")
    if sum(i.file_size for i in members) > 8 * MAX_PACKAGE_BYTES:
        raise PackageError("working_dir: unpacks to more than "
                           f"{8 * MAX_PACKAGE_BYTES >> 20} MiB")
    return members


def store_package(storage: str, data: bytes) -> tuple[str, int]:
    """Unpack an uploaded zip under ``<storage>/packages/<id>``; (id, files). The same
    content gives the same id, stored once."""
    if len(data) > MAX_PACKAGE_BYTES:
        raise PackageError(f"working_dir: {len(data)} bytes; at most {MAX_PACKAGE_BYTES}")
    package_id = "pkg-" + hashlib.sha256(data).hexdigest()[:32]
    target = package_dir(storage, package_id)
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise PackageError("working_dir: the upload is not a zip file") from None
    with zf:
        members = _safe_members(zf)
        if not os.path.isdir(target):
            partial = target + ".partial"
            zf.extractall(partial, members)
            os.replace(partial, target)
    return package_id, len(members)


def package_dir(storage: str, package_id: str) -> str:
    return os.path.join(os.path.abspath(storage), "packages", package_id)


def runtime_working_dir(storage: str, reference: str) -> str:
    """What Ray's job API takes for a spec's ``working_dir``: the stored package's
    directory, or the Ray URI as given. PackageError when neither exists."""
    if RAY_URI.match(reference):
        return reference
    if PACKAGE_ID.match(reference) and os.path.isdir(package_dir(storage, reference)):
        return package_dir(storage, reference)
    raise PackageError(f"working_dir: {reference!r} is neither an uploaded package "
                       "(POST /v1/packages) nor a Ray package URI (gcs://_ray_pkg_....zip)")
