"""Every Python block of README.md and docs/*.md runs as written or is a marked excerpt.

A ```python block is either
- a complete script: run in a subprocess with a temporary working directory (on 2 ranks with
  `python -m torch.distributed.run --standalone --nproc-per-node 2` when it calls
  `init_process_group`; against a loopback S3 server, its buckets created, when it names
  `s3://` paths), or
- an excerpt, marked by the line `<!-- excerpt: PATH -->` right before its fence (PATH relative
  to the repository root): every line of the block appears in that file, in order. In the
  block, `...` lines stand for omitted code, comment-only and blank lines are skipped, and a
  trailing `# comment` may differ from the file's.

Also: every `dist-ckpt VERB` the README names has `--help`, and every example a page names
exists and is run by a test in tests/examples.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXCERPT = re.compile(r"^<!--\s*excerpt:\s*(\S+)\s*-->$")
TRAILING_COMMENT = re.compile(r"  +#.*$")  # PEP 8 inline comments: two spaces, then #


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    excerpt_of: Optional[str]

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks() -> List[Block]:
    found: List[Block] = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                marker = EXCERPT.match(before.strip())
                code = "\n".join(lines[i + 1 : end]) + "\n"
                found.append(Block(page, i + 1, code, marker.group(1) if marker else None))
                i = end
            i += 1
    return found


BLOCKS = _blocks()


def _normalized(line: str) -> str:
    return TRAILING_COMMENT.sub("", line).strip()


def test_pages_have_python_blocks():
    assert len(BLOCKS) >= 5, [b.name for b in BLOCKS]
    assert any(b.page.name == "README.md" for b in BLOCKS)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.excerpt_of], ids=lambda b: b.name)
def test_excerpt_lines_appear_in_order_in_the_named_file(block):
    assert block.excerpt_of is not None
    source = (ROOT / block.excerpt_of).resolve()
    assert source.is_relative_to(ROOT) and source.is_file(), f"{block.name}: no {source}"
    have = [_normalized(line) for line in source.read_text().splitlines()]
    at = 0
    for line in block.code.splitlines():
        want = _normalized(line)
        if not want or want == "..." or want.startswith("#"):
            continue
        try:
            at = have.index(want, at) + 1
        except ValueError:
            pytest.fail(f"{block.name}: not in {block.excerpt_of} (after line {at}): {line!r}")


def _run(block: Block, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    script = cwd / "block.py"
    script.write_text(block.code)
    cmd = [sys.executable, str(script)]
    if "init_process_group" in block.code:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.excerpt_of], ids=lambda b: b.name)
def test_unmarked_block_runs_as_written(block, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    before = sorted(ROOT.iterdir())
    server = None
    try:
        if "s3://" in block.code:
            boto3 = pytest.importorskip("boto3")
            from tests.s3._server import env as s3_env
            from tests.s3._server import start_server

            server, endpoint = start_server()
            env.update(s3_env(endpoint))
            client = boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name="us-east-1",
                aws_access_key_id="test",
                aws_secret_access_key="test",
            )
            for bucket in sorted(set(re.findall(r"s3://([a-z0-9.-]+)/", block.code))):
                client.create_bucket(Bucket=bucket)
        out = _run(block, tmp_path, env)
    finally:
        if server is not None:
            server.kill()
            server.wait()
    assert out.returncode == 0, f"{block.name} does not run as written:\n{out.stdout}{out.stderr}"
    assert sorted(ROOT.iterdir()) == before, f"{block.name} wrote into the repository"


README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("verb", sorted(set(re.findall(r"`dist-ckpt ([a-z][a-z-]*)", README))))
def test_every_verb_the_readme_names_has_help(verb, capsys):
    from dist_checkpointing.cli import main

    with pytest.raises(SystemExit) as stopped:
        main([verb, "--help"])
    assert stopped.value.code == 0
    assert f"dist-ckpt {verb}" in capsys.readouterr().out


def test_every_example_a_page_names_exists_and_is_run_by_a_test():
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"(?<![\w/])examples/(\w+\.py)", page.read_text()))
    assert "quickstart.py" in named, named
    tests = "".join(p.read_text() for p in (ROOT / "tests" / "examples").glob("test_*.py"))
    for name in sorted(named):
        assert (ROOT / "examples" / name).is_file(), f"a page names examples/{name}"
        assert f'"{name}"' in tests or f"examples/{name}" in tests or f'"{name[:-3]}"' in tests, (
            f"no test in tests/examples runs examples/{name}"
        )
