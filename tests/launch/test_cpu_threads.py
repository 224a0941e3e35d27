"""The main job's CPU thread count (launch/cpu_threads.py): one thread per core left idle by other processes,
measured from /proc/stat; --threads or OMP_NUM_THREADS win; what was chosen is printed and recorded."""

import pytest
import torch

from launch import cpu_threads as T

STAT = """cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0
cpu0 1 0 1 1 0 0 0 0 0 0
cpu1 1 0 1 1 0 0 0 0 0 0
intr 12345
"""


def sample(user, system, idle, iowait=0):
    return T.parse_proc_stat(STAT.format(user=user, system=system, idle=idle, iowait=iowait))


def test_idle_cores_from_two_samples_of_proc_stat():
    first = sample(1000, 100, 5000)
    assert first == T.CpuTimes(idle=5000, total=6100, online=2)
    one_busy = sample(1100, 100, 5100)  # 100 jiffies busy, 100 idle: one of two cores
    assert T.idle_between(first, one_busy) == pytest.approx(1.0)
    assert T.idle_between(first, sample(1000, 100, 5150, iowait=50)) == pytest.approx(2.0)  # I/O wait is idle
    assert T.idle_between(first, first) is None
    assert T.parse_proc_stat("") is None and T.parse_proc_stat("intr 1 2 3\n") is None


def test_idle_cores_reads_the_file_it_is_given(tmp_path):
    assert T.idle_cores(0.0, str(tmp_path / "missing")) is None
    stat = tmp_path / "stat"
    stat.write_text(STAT.format(user=1, system=1, idle=1, iowait=0))
    assert T.idle_cores(0.0, str(stat)) is None  # nothing elapsed between the two reads


@pytest.mark.parametrize("idle,usable,threads", [(0.0, 2, 1), (0.4, 2, 1), (1.0, 2, 1), (1.6, 2, 2), (2.0, 2, 2),
                                                 (7.9, 4, 4), (3.0, 16, 3)])
def test_one_thread_per_idle_core(idle, usable, threads):
    choice = T.choose_threads(None, idle, usable)
    assert choice.threads == threads and f"{idle:.1f} of {usable} usable cores idle" in choice.reason


def test_requested_threads_win_and_must_be_positive():
    assert T.choose_threads(3, 0.0, 2) == T.ThreadChoice(3, "as requested")
    with pytest.raises(ValueError, match="--threads must be at least 1"):
        T.choose_threads(0, 2.0, 2)
    assert T.choose_threads(None, None, 4).threads == 4  # nothing measured: every usable core


def test_main_job_sets_and_reports_the_threads(tmp_path, capsys, monkeypatch):
    from launch import main as M

    device = torch.device("cpu")
    args = type("Args", (), {"threads": 1})()
    assert M.set_cpu_threads(args, device, None).threads == 1 and torch.get_num_threads() == 1
    assert "CPU threads: 1 (as requested; --threads N to choose)" in capsys.readouterr().out
    args.threads = None
    torch.set_num_threads(2)
    assert M.set_cpu_threads(args, device, "2").reason == "OMP_NUM_THREADS=2" and torch.get_num_threads() == 2
    monkeypatch.setattr(T, "idle_cores", lambda: 1.0)
    monkeypatch.setattr(T, "usable_cores", lambda: 2)
    assert M.set_cpu_threads(args, device, None).threads == 1
    assert M.set_cpu_threads(args, torch.device("cuda"), None) is None
