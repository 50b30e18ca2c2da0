"""Ctrl-C during a long run: exit 130, one line, and no output file (whole or partial)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers_signals import popen_taking_ctrl_c


def _cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _past_start_up(child: subprocess.Popen, cpu_s: float = 1.5, wall_s: float = 60.0) -> None:
    """Wait until the child has used `cpu_s` of CPU (its imports take a few tenths): on a
    loaded machine a fixed sleep can land inside the imports, before zsim handles Ctrl-C."""
    end = time.monotonic() + wall_s
    while child.poll() is None and time.monotonic() < end and _cpu_s(child.pid) < cpu_s:
        time.sleep(0.05)


def test_ctrl_c_during_a_long_run_leaves_no_output_file(tmp_path):
    # 1T parameters on 3,072 GPUs, 512 micro-batches: many seconds of simulation
    args = "--topology 384x8-dgx-a100 --model gpt-175b --layers 128 --hidden 25600 --heads 160"
    args += " --tp 8 --pp 64 --pipeline-engine megatron --micro-batch 1 --grad-accum 512"
    trace, plot = tmp_path / "step.json", tmp_path / "step.png"
    command = [sys.executable, "-m", "zsim", "run", *args.split()]
    command += ["--trace", str(trace), "--plot", str(plot)]
    child = popen_taking_ctrl_c(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _past_start_up(child)  # inside the simulation
    assert child.poll() is None, "the run ended before it could be interrupted"
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 130
    assert err.strip() == "zsim: interrupted"
    assert "Traceback" not in out + err
    assert list(tmp_path.iterdir()) == []


def test_a_ctrl_c_python_swallowed_still_stops_the_run(tmp_path, monkeypatch, capsys):
    # a Ctrl-C that lands while a finalizer runs (a simpy generator being collected) is only
    # "Exception ignored" by Python; zsim keeps it and stops before writing anything
    from zsim.cli import main
    from zsim.cli import run as run_command

    class Finalizer:
        def __del__(self):
            raise KeyboardInterrupt

    real = run_command.simulate

    def simulate(*args, **kwargs):
        Finalizer()  # collected at once: its KeyboardInterrupt goes to sys.unraisablehook
        return real(*args, **kwargs)

    monkeypatch.setattr(run_command, "simulate", simulate)
    plot = tmp_path / "step.png"
    assert main(["run", "--topology", "1x8-nvlink", "--plot", str(plot)]) == 130
    assert capsys.readouterr().err.strip() == "zsim: interrupted"
    assert not plot.exists()
