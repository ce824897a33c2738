"""What the benches ask of a running mlxbcd through the `mlxbc` CLI: one
answer's statistics (`mlxbc ask --json`), and the wait while a GPU daemon
warms its batch sizes after a load (rounds run alongside would time the
warming: an 8B shape's first size took 38 s on an H100)."""
import json, os, subprocess, time


def ask_stats(mlxbc, home, args, timeout=600):
    """`mlxbc ask --json ARGS` against the daemon of `home`: the answer's
    statistics (the `done` event's)."""
    out = subprocess.run([mlxbc, "ask", "--json", *args], capture_output=True, text=True,
                         env=dict(os.environ, MLXBC_HOME=home), timeout=timeout)
    for line in out.stdout.splitlines():
        ev = json.loads(line)
        if ev.get("event") == "done":
            return ev["stats"]
    raise RuntimeError(f"no answer: {out.stderr[-400:]}")


def ps(mlxbc, home):
    return subprocess.run([mlxbc, "ps"], capture_output=True, text=True, env=dict(os.environ, MLXBC_HOME=home)).stdout


def wait_warm(mlxbc, home, most=600):
    """Waits while `mlxbc ps` says "warming batches"."""
    deadline = time.monotonic() + most
    while "warming" in ps(mlxbc, home):
        if time.monotonic() > deadline:
            raise SystemExit(f"{home}: still warming batch sizes after {most} s")
        time.sleep(1)
