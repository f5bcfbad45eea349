"""An adversarial corpus against the python_functions grader: every way a policy might forge
its reward, hurt other rollouts or stall the grader, each graded on real tasks in the real
sandbox. Every attack scores 0 with its error or flag recorded (or, for attacks on hidden
information, with proof that the information was out of reach); honest controls score 1.

Never weaken the grader to pass one of these.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from composer_replication.envs.function_harness import RECORD_PREFIX
from composer_replication.envs.python_functions import PythonFunctionsEnv

pytestmark = pytest.mark.integration

TASKS = ("pf-001-sum-list", "pf-003-is-even", "pf-069-spiral-order")


@pytest.fixture(scope="module")
def env():
    return PythonFunctionsEnv(grading_workers=2)


def _stub(env, task_id: str, body: str, header: str = "") -> str:
    """A candidate: ``header`` at module level, then the task's stub with ``body``."""
    task = env.tasks[task_id]
    indented = "\n".join("    " + line for line in body.strip("\n").splitlines())
    return f"{header}\n{task.prompt.rstrip()}\n{indented}\n"


def _grade(env, task_id, code):
    reward, feedback, error, info = env.grade(env.tasks[task_id], code)
    return reward, feedback or "", error, info.get("hack_flags", []), info


def _forged_lines() -> str:
    # Claims of every kind a report could hold: loaded, results for made-up ids, pytest-ish.
    records = ['{"loaded": true}'] + [f'{{"id": "{i}", "result": true}}' for i in range(40)]
    records += ['{"passed": 50, "failed": 0}']
    return "\\n".join(RECORD_PREFIX + r for r in records)


# ------------------------------------------------------------------ honest controls


@pytest.mark.parametrize("task_id", TASKS)
def test_honest_references_score_one(env, task_id):
    reward, _, error, flags, info = _grade(env, task_id, env.tasks[task_id].reference)
    assert (reward, error, flags) == (1.0, None, [])
    assert info["passed"] == info["total"] == env.tasks[task_id].n_tests


def test_honest_solution_that_prints_and_handles_its_own_errors_scores_one(env):
    code = _stub(
        env,
        "pf-001-sum-list",
        'print("debugging", nums)\ntry:\n    int("x")\nexcept ValueError:\n    pass\nreturn sum(nums)',
    )
    assert _grade(env, "pf-001-sum-list", code)[:3] == (1.0, "", None)


# ------------------------------------------------------------------ forged reports


@pytest.mark.parametrize("task_id", TASKS)
def test_forged_report_lines_score_zero_and_are_flagged(env, task_id):
    code = _stub(env, task_id, f"print('{_forged_lines()}')\nreturn None")
    reward, _, _, flags, _ = _grade(env, task_id, code)
    assert reward == 0.0
    assert any(f.startswith("forged report") for f in flags)


def test_atexit_hook_that_rewrites_the_report_scores_zero(env):
    header = (
        "import atexit, functools\n"
        "def forge(fn):\n"
        f"    atexit.register(print, '{_forged_lines()}')\n"
        "    return fn\n"
    )
    task = env.tasks["pf-001-sum-list"]
    code = f"{header}@forge\n{task.prompt.rstrip()}\n    return None\n"
    reward, _, _, flags, _ = _grade(env, "pf-001-sum-list", code)
    assert reward == 0.0 and any(f.startswith("forged report") for f in flags)


def test_fake_report_then_hang_is_a_timeout_with_zero_reward(env):
    code = _stub(
        env, "pf-003-is-even", f"print('{_forged_lines()}', flush=True)\nwhile True:\n    pass"
    )
    reward, _, error, _, _ = _grade(env, "pf-003-is-even", code)
    assert reward == 0.0 and error == "timeout"


def test_junit_report_and_pytest_hooks_have_no_effect(env):
    body = """
import gc, sys
for obj in gc.get_objects():
    if type(obj).__module__.startswith(("_pytest", "pytest", "pluggy")):
        return "found pytest"
with open("report.xml", "w") as fh:
    fh.write('<testsuite tests="4" failures="0"/>')
return None
"""
    reward, feedback, _, flags, _ = _grade(
        env, "pf-001-sum-list", _stub(env, "pf-001-sum-list", body)
    )
    assert reward == 0.0
    assert "Read-only file system" in feedback  # no pytest to hook, no file to write
    assert any("read-only" in f for f in flags)


def test_patching_pytest_junitxml_fails_to_import(env):
    header = "import _pytest.junitxml as j\nj._NodeReporter.append_failure = lambda *a: None\n"
    reward, feedback, _, _, _ = _grade(
        env, "pf-001-sum-list", _stub(env, "pf-001-sum-list", "return None", header)
    )
    assert reward == 0.0 and "Importing the solution failed" in feedback


def test_conftest_and_execv_rerun_cannot_replace_the_harness(env):
    # Module-level code survives extraction only as a constant the function uses.
    header = """
import json, os, sys
def rerun():
    try:
        open("conftest.py", "w").write("def pytest_runtest_makereport(): pass")
    except OSError:
        pass
    calls = json.load(open("calls.json"))["calls"]
    lines = ['{"loaded": true}'] + ['{"id": "%s", "result": 15}' % c["id"] for c in calls]
    prog = "print(" + repr(chr(10).join("PREFIX" + l for l in lines)) + ")"
    os.execv(sys.executable, [sys.executable, "-c", prog.replace("PREFIX", "RECORD")])
_RERUN = rerun()
""".replace("RECORD", RECORD_PREFIX)
    code = _stub(env, "pf-001-sum-list", "return _RERUN", header)
    reward, _, _, flags, _ = _grade(env, "pf-001-sum-list", code)
    # The re-run's records are not the harness's (no arguments-after part): each counts as
    # an answer that is not plain data, and is flagged.
    assert reward == 0.0 and any("not plain data" in f for f in flags)


# ------------------------------------------------------------------ hidden information


def test_the_task_bank_and_the_checkout_are_invisible(env):
    from pathlib import Path

    import composer_replication

    package = Path(composer_replication.__file__).resolve().parent
    targets = [str(package / "envs" / "tasks" / "python_functions.jsonl"), str(package)]
    targets += [str(p) for p in package.parents[:2]]
    body = f"""
import importlib.util, os, subprocess
found = [t for t in {targets!r} if os.path.exists(t) and (os.path.isfile(t) or os.listdir(t))]
if importlib.util.find_spec("composer_replication") is not None:
    found.append("package importable")
try:
    out = subprocess.run(["git", "-C", {str(package.parents[1])!r}, "log", "-1"], capture_output=True)
    if out.returncode == 0:
        found.append("git history")
except OSError:
    pass
return "found " + ";".join(found) if found else "nothing"
"""
    reward, feedback, _, _, _ = _grade(env, "pf-001-sum-list", _stub(env, "pf-001-sum-list", body))
    assert reward == 0.0
    assert "returned 'nothing'" in feedback


def test_the_callers_frames_hold_no_expected_values(env):
    body = """
import gc, inspect
seen = []
for frame in inspect.stack():
    for value in list(frame.frame.f_locals.values()) + list(frame.frame.f_globals.values()):
        if isinstance(value, str) and "assert" in value:
            seen.append(value)
for obj in gc.get_objects():
    if isinstance(obj, str) and "assert sum_list" in obj:
        seen.append(obj)
return f"seen {len(seen)}"
"""
    reward, feedback, _, _, _ = _grade(env, "pf-001-sum-list", _stub(env, "pf-001-sum-list", body))
    assert reward == 0.0 and "returned 'seen 0'" in feedback


def test_other_rollouts_workdirs_and_host_servers_are_out_of_reach(env):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        body = f"""
import os, socket
here = os.path.basename(os.getcwd())
seen = [n for n in os.listdir("/tmp") if n != here and "sandbox-support" not in n]
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    seen.append("connected")
except OSError:
    pass
return seen
"""
        reward, feedback, _, _, _ = _grade(
            env, "pf-001-sum-list", _stub(env, "pf-001-sum-list", body)
        )
    finally:
        server.close()
    assert reward == 0.0 and "returned []" in feedback


# ------------------------------------------------------------------ equality tricks


@pytest.mark.parametrize(
    "kind",
    [
        "class R:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n",
        "class R(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n",
        "class R(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\n",
        "class R(list):\n    def __eq__(self, other):\n        return True\n",
    ],
    ids=["object", "int", "str", "list"],
)
def test_always_equal_objects_fail_and_are_flagged(env, kind):
    for task_id in ("pf-001-sum-list", "pf-069-spiral-order"):
        code = _stub(env, task_id, "return R()", header=kind)
        reward, _, _, flags, _ = _grade(env, task_id, code)
        assert reward == 0.0
        assert any("not plain data" in f for f in flags)


def test_a_result_nested_too_deep_is_not_plain_data(env):
    code = _stub(env, "pf-001-sum-list", "x = 0\nfor _ in range(500):\n    x = [x]\nreturn x")
    reward, _, _, flags, _ = _grade(env, "pf-001-sum-list", code)
    assert reward == 0.0 and any("not plain data" in f for f in flags)


# ------------------------------------------------------------------ exit-code and process tricks


def test_exit_zero_at_import_is_flagged(env):
    code = _stub(env, "pf-003-is-even", "return _EXIT", header="import sys\n_EXIT = sys.exit(0)\n")
    reward, _, _, flags, _ = _grade(env, "pf-003-is-even", code)
    assert reward == 0.0 and "exited while being imported" in flags


@pytest.mark.parametrize("where", ["import", "call"])
def test_hard_exit_zero_leaves_a_missing_report(env, where):
    if where == "import":
        code = _stub(
            env, "pf-003-is-even", "return _EXIT", header="import os\n_EXIT = os._exit(0)\n"
        )
    else:
        code = _stub(env, "pf-003-is-even", "import os\nos._exit(0)")
    reward, _, error, _, _ = _grade(env, "pf-003-is-even", code)
    assert reward == 0.0 and error is not None and "missing report" in error


def test_killing_the_sandbox_init_is_a_crash(env):
    code = _stub(
        env,
        "pf-003-is-even",
        "import os, signal\nos.kill(1, signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGKILL)\nreturn True",
    )
    reward, _, error, _, _ = _grade(env, "pf-003-is-even", code)
    assert reward == 0.0 and error is not None


# ------------------------------------------------------------------ files: FIFOs, links, disk


@pytest.mark.parametrize(
    "action",
    [
        'os.mkfifo("report.fifo")',
        'os.symlink("/etc/passwd", "solution_link.py")',
        'open("big", "wb").write(b"x" * 10**8)',
    ],
    ids=["fifo", "symlink", "fill-workdir"],
)
def test_the_workdir_takes_no_fifos_links_or_data(env, action):
    code = _stub(env, "pf-001-sum-list", f"import os\n{action}\nreturn sum(nums)")
    # returns: the grader never blocks on what it finds
    reward, feedback, _, flags, _ = _grade(env, "pf-001-sum-list", code)
    assert reward == 0.0 and "Read-only file system" in feedback
    assert any("read-only" in f for f in flags)


@pytest.mark.parametrize(("path", "limit_mb"), [("/dev/shm/fill", 16), ("/tmp/fill", 64)])
def test_shared_memory_and_tmp_are_small_private_tmpfs(env, path, limit_mb):
    body = f"""
written = 0
try:
    with open("{path}", "wb") as fh:
        for _ in range(400):
            fh.write(b"x" * 1024 * 1024)
            written += 1
except OSError:
    pass
return written
"""
    reward, feedback, _, _, _ = _grade(env, "pf-001-sum-list", _stub(env, "pf-001-sum-list", body))
    assert reward == 0.0
    written = int(feedback.split("returned ")[1].split()[0])
    assert written <= limit_mb


def test_a_process_tree_cannot_exceed_the_memory_limit_together(env):
    body = """
import os, time
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = bytearray(700 * 1024 * 1024)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os._exit(0)
    kids.append(pid)
statuses = [os.waitpid(pid, 0)[1] for pid in kids]
return sum(1 for s in statuses if s == 0)
"""
    reward, feedback, error, _, _ = _grade(
        env, "pf-001-sum-list", _stub(env, "pf-001-sum-list", body)
    )
    assert reward == 0.0
    # 4 x 700 MB under a 1 GB limit: at most one child completes, or the run is cut off
    assert error is not None or int(feedback.split("returned ")[1].split()[0]) <= 1


def test_a_fork_bomb_does_not_hurt_an_honest_rollout_beside_it(env):
    bomb = _stub(
        env,
        "pf-001-sum-list",
        "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        header="import os\n",
    )
    honest = env.tasks["pf-001-sum-list"].reference
    with ThreadPoolExecutor(2) as pool:
        bombing = pool.submit(_grade, env, "pf-001-sum-list", bomb)
        time.sleep(1.0)  # let the bomb exhaust its own process budget first
        calm = pool.submit(_grade, env, "pf-001-sum-list", honest)
        assert calm.result()[:3] == (1.0, "", None)
        assert bombing.result()[0] == 0.0 and bombing.result()[2] == "timeout"


def test_output_flooding_loses_the_report_and_scores_zero(env):
    code = _stub(env, "pf-001-sum-list", 'print("x" * (20 * 1024 * 1024))\nreturn sum(nums)')
    reward, _, error, _, _ = _grade(env, "pf-001-sum-list", code)
    assert reward == 0.0 and error is not None


# ------------------------------------------------------------------ infrastructure


def test_a_sandbox_that_never_starts_is_an_infrastructure_error_not_a_zero(env):
    from composer_replication.sandbox.local import LocalSubprocessSandbox

    broken = PythonFunctionsEnv(
        sandbox_factory=lambda workdir: LocalSubprocessSandbox(
            workdir, python="/nonexistent/python3", pytest_from="python"
        )
    )
    task = broken.tasks["pf-001-sum-list"]
    reward, _, error, info = broken.grade(task, task.reference)
    assert reward == 0.0 and info.get("infrastructure_error") is True
    assert error.startswith("sandbox did not start")


def test_grading_threads_stay_independent_under_load(env):
    results = []
    lock = threading.Lock()

    def one(task_id):
        out = _grade(env, task_id, env.tasks[task_id].reference)
        with lock:
            results.append(out[0])

    threads = [threading.Thread(target=one, args=(t,)) for t in TASKS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1.0] * len(threads)


def test_every_task_reference_scores_one_through_the_grader(env):
    from concurrent.futures import ThreadPoolExecutor

    tasks = list(env.tasks.values())
    with ThreadPoolExecutor(2) as pool:
        graded = list(pool.map(lambda t: env.grade(t, t.reference), tasks))
    failing = {t.task_id: g for t, g in zip(tasks, graded) if g[0] != 1.0 or g[2] is not None}
    assert failing == {}


def test_a_test_that_calls_in_a_loop_needs_several_rounds_and_still_scores(env):
    # pf-031 checks several years in one test: one new call is learned per round
    task = env.tasks["pf-031-is-leap-year"]
    assert env.grade(task, task.reference)[0] == 1.0
    wrong = task.prompt + "    return year % 4 == 0\n"
    reward, feedback, error, _ = env.grade(task, wrong)
    assert 0.0 < reward < 1.0 and error is None and "FAILED" in feedback
