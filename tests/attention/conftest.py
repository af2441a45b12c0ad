"""Where this folder's kernel tests run: on a GPU compiled, elsewhere in Triton's interpreter.

Triton fixes its mode (compiled or interpreted) when it is imported and when ``@triton.jit``
decorates a function, from ``TRITON_INTERPRET``; and transformers' model modules import triton
(through ``torch._dynamo``) long before this folder is collected in a full run. So on a machine
without a GPU this folder's tests run in one child process that has ``TRITON_INTERPRET=1`` from
its start: the parent process (the ordinary test run) starts it once, at this folder's first
test, for exactly the tests it selected, and each test here then reports its own outcome from
the child (failure text included). Nothing outside this folder ever sees the variable or an
interpreted triton. With a GPU, or when the whole run already has ``TRITON_INTERPRET=1``, the
tests run in place. Tests marked ``compiled`` (ahead-of-time compilation for a GPU, which needs
no GPU) always run in the ordinary process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
#: the tests run in this process (a GPU, or the interpreter child itself)
IN_PLACE = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
REPORT = "JETFLOW_KERNEL_TEST_REPORT"  # the child appends one JSON line per test phase here
HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "compiled: needs a process in which triton compiles (not interpreted)")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture(scope="session")
def kernels():
    """The kernel module where the tests run (the child or a GPU run); None in the parent,
    which only relays the child's outcomes."""
    if not IN_PLACE:
        return None
    from jetflow.attention import tree_attention

    assert tree_attention.INTERPRETED != ON_GPU
    return tree_attention


if IN_PLACE:
    if REPORT in os.environ:

        def pytest_runtest_logreport(report: pytest.TestReport) -> None:
            entry = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
            if report.failed:
                entry["text"] = report.longreprtext
            elif report.skipped and isinstance(report.longrepr, tuple):
                entry["text"] = report.longrepr[2]
            with open(os.environ[REPORT], "a", encoding="utf-8") as sink:
                sink.write(json.dumps(entry) + "\n")

else:
    _outcomes: dict[str, dict] | None = None

    def _mine(item: pytest.Item) -> bool:
        """A test the child runs: this folder's, except those that need triton to compile."""
        return HERE in Path(item.path).resolve().parents and item.get_closest_marker("compiled") is None

    def _run_child(session: pytest.Session) -> dict[str, dict]:
        """Run this folder's selected tests once in an interpreter child; outcome per node id."""
        nodeids = [item.nodeid for item in session.items if _mine(item)]
        with tempfile.TemporaryDirectory() as folder:
            report = Path(folder) / "report.jsonl"
            env = {**os.environ, "TRITON_INTERPRET": "1", REPORT: str(report)}
            child = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids],
                cwd=session.config.rootpath,
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            lines = report.read_text(encoding="utf-8").splitlines() if report.exists() else []
        outcomes: dict[str, dict] = {}
        for entry in map(json.loads, lines):
            seen = outcomes.setdefault(entry["nodeid"], {"outcome": "passed", "text": ""})
            if entry["outcome"] == "failed" or (
                entry["outcome"] == "skipped" and seen["outcome"] == "passed"
            ):
                seen.update(outcome=entry["outcome"], text=entry.get("text", ""))
        outcomes["<child>"] = {"text": (child.stdout + child.stderr)[-4000:]}
        return outcomes

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
        """Report the child's outcome of this test instead of running it here."""
        global _outcomes
        if not _mine(pyfuncitem):
            return None
        if _outcomes is None:
            _outcomes = _run_child(pyfuncitem.session)
        outcome = _outcomes.get(pyfuncitem.nodeid)
        if outcome is None:
            pytest.fail(f"the interpreter child did not run this test:\n{_outcomes['<child>']['text']}")
        if outcome["outcome"] == "failed":
            pytest.fail(f"in the interpreter child:\n{outcome['text']}", pytrace=False)
        if outcome["outcome"] == "skipped":
            pytest.skip(outcome["text"])
        return True
