"""The scripts of examples/ and the README's API section made of them.

* Every example runs as written, in its own process, on the reference path (no GPU, no
  interpreter), and ends by printing OK; those of moe_kernels alone also with their Triton kernels
  in the interpreter (``TRITON_INTERPRET=1``); on a CUDA machine (``-m gpu``) on the GPU too.
* Every Python block of README.md is preceded by ``<!-- from examples/NAME.py -->`` and is,
  verbatim, a region of that example between the lines ``# README >>>`` and ``# README <<<``;
  every such region appears in the README once, in the example's order. After editing a region,
  ``python packages/moe-tools/tests/test_examples.py`` copies the regions into the README.
* Those blocks, read one example at a time, define every name they use; the examples choose their
  device (no "cuda" written into a call) and read no private name (moe_kernels', moe_model's or
  torch's).
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import subprocess
import symtable
import sys
from pathlib import Path

import pytest
import torch

import moe_kernels
import moe_model
from moe_kernels.testing.layering import private_reads

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"
START, END = "# README >>>", "# README <<<"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))


def source(name: str) -> str:
    """The text of example ``name`` (files are read as UTF-8 here, whatever the locale)."""
    return (EXAMPLES / name).read_text(encoding="utf-8")


KERNEL_SCRIPTS = [name for name in SCRIPTS if "moe_model" not in source(name)]
BLOCK = re.compile(r"<!-- from (examples/[\w.]+) -->\n```python\n(.*?)```\n", re.S)


def regions(name: str) -> list[str]:
    """The README regions of example ``name``, in order (the lines between the markers)."""
    found, current = [], None
    for line in source(name).splitlines(keepends=True):
        if line.strip() == START:
            assert current is None, f"{name}: {START} inside a region"
            current = []
        elif line.strip() == END:
            assert current is not None, f"{name}: {END} without {START}"
            found.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    assert current is None, f"{name}: a region without {END}"
    return found


def readme_blocks() -> list[tuple[str, str]]:
    """(example name, code) of every python block of README.md that names its example."""
    text = README.read_text(encoding="utf-8")
    blocks = [(m.group(1).removeprefix("examples/"), m.group(2)) for m in BLOCK.finditer(text)]
    assert len(blocks) == text.count("```python"), "a python block without <!-- from ... -->"
    return blocks


def undefined_names(code: str) -> set[str]:
    """Names ``code`` reads (at module level or as globals of its functions and comprehensions)
    that it never binds and that are not builtins."""
    top = symtable.symtable(code, "<readme>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    bound |= {s.get_name() for s in top.get_symbols() if s.is_namespace()}
    used, tables = set(), [top]
    while tables:
        table = tables.pop()
        used |= {
            s.get_name()
            for s in table.get_symbols()
            if s.is_referenced() and (table is top or s.is_global())
        }
        tables += table.get_children()
    return used - bound - set(dir(builtins))


def needs(name: str) -> None:
    """Skip unless the optional packages example ``name`` imports are installed (transformers:
    moe-model's ``hf`` extra, installed by nox's newest-torch ``tests`` session)."""
    if re.search(r"^import transformers", source(name), re.M):
        pytest.importorskip("transformers", minversion="5.0", reason=f"{name} needs it")


def run_example(name: str, hide_gpu: bool = True, interpret: bool = False) -> str:
    needs(name)
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"}
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.rstrip().endswith("OK"), done.stdout
    return done.stdout


def test_there_are_examples():
    assert len(SCRIPTS) >= 4 and all(regions(name) for name in SCRIPTS), SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_runs(name):
    run_example(name)


@pytest.mark.parametrize("name", KERNEL_SCRIPTS)
def test_kernel_example_runs_in_the_interpreter(name):
    pytest.importorskip("triton", reason="the interpreter is Triton's")
    pytest.importorskip("numpy", reason="Triton's interpreter imports numpy")
    run_example(name, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", SCRIPTS)
def test_example_runs_on_gpu(name):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert "device cuda" in run_example(name, hide_gpu=False)


def test_readme_blocks_are_example_regions():
    shown: dict[str, list[str]] = {}
    for name, code in readme_blocks():
        assert name in SCRIPTS, f"README names {name}, not a script in examples/"
        shown.setdefault(name, []).append(code)
    for name in SCRIPTS:
        want = regions(name)
        got = shown.get(name, [])
        for i, (a, b) in enumerate(zip(got, want, strict=False)):
            assert a == b, (
                f"README's block {i + 1} from examples/{name} is not its region {i + 1} (python "
                f"packages/moe-tools/tests/test_examples.py copies them); the region:\n{b}"
            )
        assert len(got) == len(want), f"examples/{name}: {len(want)} regions, {len(got)} shown"


def test_readme_blocks_define_their_names():
    shown: dict[str, str] = {}
    for name, code in readme_blocks():
        shown[name] = shown.get(name, "") + code
    for name, code in shown.items():
        missing = sorted(undefined_names(code))
        assert not missing, f"examples/{name}'s README blocks read undefined names {missing}"


def test_examples_choose_their_device():
    """One line picks the device; "cuda" appears elsewhere only compared with (device == "cuda")."""
    choice = 'device = "cuda" if torch.cuda.is_available() else "cpu"'
    for name in SCRIPTS:
        text = source(name)
        assert text.count(choice) == 1, name
        rest = text.replace(choice, "")
        assert not re.search(r"""(?<!== )["']cuda(:\d+)?["']|\.cuda\(""", rest), name


def _private(name: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in name.split("."))


def test_examples_read_no_private_names():
    roots = {m.__name__: Path(m.__file__).parent for m in (moe_kernels, moe_model)}
    assert private_reads(EXAMPLES, roots) == []
    for name in SCRIPTS:  # stricter: no underscore attribute or import at all, torch's included
        for node in ast.walk(ast.parse(source(name))):
            if isinstance(node, ast.Attribute):
                assert not _private(node.attr), f"{name}:{node.lineno} reads .{node.attr}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(map(_private, names)), f"{name}:{node.lineno} imports {names}"


def copy_regions_into_readme() -> None:
    """Rewrite each README block from its example's region (the n-th block naming an example
    gets its n-th region)."""
    seen: dict[str, int] = {}

    def block(match: re.Match) -> str:
        name = match.group(1).removeprefix("examples/")
        i = seen[name] = seen.get(name, -1) + 1
        return f"<!-- from examples/{name} -->\n```python\n{regions(name)[i]}```\n"

    README.write_text(BLOCK.sub(block, README.read_text(encoding="utf-8")), encoding="utf-8")


if __name__ == "__main__":
    copy_regions_into_readme()
