"""Two local processes x 4 CPU devices = one 8-device mesh: sharded ring attention end to end.

Runs ``mp_worker.py`` twice with ``jax.distributed`` over loopback (gloo CPU collectives) and
requires both to match the single-process reference.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

TIMEOUT_S = 120
WORKER = Path(__file__).with_name("mp_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_ring_matches_reference():
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), "2"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    deadline = time.monotonic() + TIMEOUT_S  # for both processes together
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = outputs + [p.communicate()[0] for p in procs[len(outputs) :]]
        pytest.fail(f"multi-process run timed out after {TIMEOUT_S} s:\n" + "\n".join(logs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    report = "\n".join(
        f"--- process {i} (exit {p.returncode}) ---\n{out}"
        for i, (p, out) in enumerate(zip(procs, outputs, strict=True))
    )
    assert all(p.returncode == 0 for p in procs), report
    for i, out in enumerate(outputs):
        assert f"process {i}: dk max abs error" in out, report
