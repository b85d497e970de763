"""The README's Python blocks run as written, in order, in one namespace (so the README cannot
rot): each in a fresh temporary directory shared by all, with its printed output checked against
the ``# prints: ...`` lines the README shows under it (outputs that are the same on any machine:
plans for a named GPU)."""
import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def promised_output(block: str) -> list[str]:
    return [m.strip() for m in re.findall(r"#\s*prints:\s*(.+)$", block, re.M)]


def test_readme_has_blocks_to_run():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 6
    assert sum(len(promised_output(b)) for b in blocks) >= 3


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__"}
    for i, block in enumerate(python_blocks(README.read_text())):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                exec(compile(block, f"README.md python block {i}", "exec"), namespace)
            except Exception as e:  # name the block: the README is what to fix
                raise AssertionError(f"README python block {i} fails: {type(e).__name__}: {e}\n"
                                     f"{block}") from e
        printed = " ".join(out.getvalue().split())
        for line in promised_output(block):
            assert " ".join(line.split()) in printed, (i, line, out.getvalue()[:2000])
