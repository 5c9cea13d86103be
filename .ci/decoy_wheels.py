"""Stand-ins for PyPI's unrelated ``moe-kernels`` project (versions 0.1.1 and 0.8.2; it imports
as ``moe_kernels`` too) as tiny wheels in OUTDIR, for ``nox -s build`` to offer pip and check
that our packages never resolve to them. Usage: python decoy_wheels.py OUTDIR"""

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

VERSIONS = ("0.1.1", "0.8.2")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def decoy(out: Path, version: str) -> Path:
    info = f"moe_kernels-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: moe-kernels\nVersion: {version}\n"
    files = {
        "moe_kernels/__init__.py": b"raise ImportError('a stand-in for another moe-kernels')\n",
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: decoy\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    path = out / f"moe_kernels-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    for v in VERSIONS:
        print(decoy(folder, v))
