"""The `lmloss` command and `lmloss_train`: every allocation checked (a
shape too large for memory fails with a message and status 2, never a
crash), unknown options refused, --version, and progress written only to
a terminal. The binaries are found beside the library the other tests
load (LMLOSS_LIBRARY), else in build/; the tests skip without them."""

import os
import pty
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(os.environ["LMLOSS_LIBRARY"]) if os.environ.get("LMLOSS_LIBRARY") \
    else os.path.join(ROOT, "build")
CLI = os.path.join(BIN, "lmloss")
TRAIN = os.path.join(BIN, "lmloss_train")


def run(exe, *args, timeout=120, tty_stderr=False):
    """(returncode, stdout, stderr) of exe with args; with tty_stderr the
    standard error is a pseudo-terminal (isatty true), stdout a pipe."""
    if not os.path.exists(exe):
        pytest.skip("%s not built" % exe)
    if not tty_stderr:
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    master, slave = pty.openpty()
    try:
        p = subprocess.run([exe, *args], stdout=subprocess.PIPE, stderr=slave, timeout=timeout)
        os.close(slave)
        slave = -1
        err = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            err += chunk
        return p.returncode, p.stdout.decode(), err.decode(errors="replace")
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


VERSION = re.compile(r"\b\d+\.\d+\.\d+\b")


@pytest.mark.parametrize("args", [["--version"], ["bench", "--version"], ["check", "--version"],
                                  ["collapse", "--version"]])
def test_version(args):
    rc, out, err = run(CLI, *args)
    assert rc == 0 and out.startswith("lmloss ") and VERSION.search(out), (rc, out, err)


def test_train_version():
    rc, out, err = run(TRAIN, "--version")
    assert rc == 0 and out.startswith("lmloss_train ") and VERSION.search(out), (rc, out, err)


@pytest.mark.parametrize("args", [["collapse", "--foo"], ["collapse", "extra"], ["check", "--foo"],
                                  ["bench", "--foo"], ["bench", "ce", "--threads", "abc"],
                                  ["bench", "ce", "--threads", "100000"],
                                  ["bench", "ce", "--reps", "0"], ["bench", "ce", "--reps", "3x"],
                                  ["bench", "ce", "--shape", "10"],
                                  ["bench", "ce", "--shape", "10,1e5"],
                                  ["bench", "ce", "--shape", "4,99999999999999"],
                                  ["bench", "ce", "--supervised", "2"], ["bench", "--device"],
                                  ["nosuchcommand"]])
def test_bad_arguments(args):
    rc, out, err = run(CLI, *args)
    assert rc == 2 and err.strip(), (rc, out, err)


@pytest.mark.parametrize("args", [["--foo"], ["--vocab", "12"], ["--steps", "x"]])
def test_train_bad_arguments(args):
    rc, out, err = run(TRAIN, *args)
    assert rc == 2 and err.strip(), (rc, out, err)


@pytest.mark.parametrize("op,shape", [("ce", "100000,1000000"), ("softmax", "1000000,1000000"),
                                      ("linear-ce", "1000,100000000,100000")])
def test_bench_too_large_fails_cleanly(op, shape):
    """Issue 35: --shape 100000,1000000 segfaulted; now a message, status 2."""
    rc, out, err = run(CLI, "bench", op, "--shape", shape, "--reps", "1")
    assert rc == 2, (rc, out, err)  # a signal would give a negative code
    assert "cannot allocate" in err, err


def test_bench_progress_only_to_a_terminal():
    args = ["bench", "ce", "logprob", "--shape", "8,64", "--reps", "1"]
    rc, out, err = run(CLI, *args)
    assert rc == 0 and "ce" in out and "logprob" in out, (rc, out, err)
    assert "[1/2]" not in err and "[1/2]" not in out, err
    rc, out, err = run(CLI, *args, tty_stderr=True)
    assert rc == 0 and "[1/2]" in err and "[2/2]" in err, (rc, out, err)
    assert "[1/2]" not in out


def test_train_estimate_and_progress():
    """The estimate comes before the first step; the progress bar only on a
    terminal."""
    args = ["--steps", "2", "--batch", "64", "--vocab", "512"]
    rc, out, err = run(TRAIN, *args, timeout=300)
    assert rc in (0, 1), (rc, out, err)  # 1: the held-out loss did not go down in 2 steps
    assert re.search(r"^estimate: about \d+ s for 2 steps", out, re.M), out
    assert out.index("estimate:") < out.index("train loss"), out
    assert "\r[" not in err and "step 2/2" not in err, err
    rc, out, err = run(TRAIN, *args, timeout=300, tty_stderr=True)
    assert rc in (0, 1) and "step 2/2" in err, (rc, out, err)
