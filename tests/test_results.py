"""docs/results.md shows the stored learning results and nothing else; every run names its clean commit.

The full-length runs themselves (hours each) are never part of the suite: they are run one command at a
time (``benchmarks/learning.py run``) and their files committed. Here: the page's table is exactly what
``report`` writes from ``benchmarks/results/learning.json`` (which says "no runs yet" until runs exist),
that summary follows from the run files, each run names a commit of this history no older than the
verdicts on the page, one tiny run of a contender writes a result file with its provenance, and a run
stopped at its time budget continues, on the code it started on only, without losing a batch.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import harness  # noqa: E402
import learning  # noqa: E402
from test_claims import _commit, _git  # noqa: E402 - one reading of a commit named on a page

PAGE = os.path.join(ROOT, "docs", "results.md")


def _stored_summary() -> dict:
    return json.load(open(learning.SUMMARY))


def test_the_page_shows_exactly_the_stored_results():
    problems = learning.check_page(open(PAGE).read(), _stored_summary())
    assert not problems, ("docs/results.md's table is not the stored results (run `python benchmarks/learning.py "
                          "report` and commit both):\n" + "\n".join(problems))


def test_the_stored_summary_follows_from_the_run_files():
    recomputed = json.loads(json.dumps(learning.summarize(learning.load_runs())))
    assert recomputed == _stored_summary(), "benchmarks/results/learning.json is stale: run `benchmarks/learning.py report`"


def test_until_runs_exist_the_page_says_so():
    summary = _stored_summary()
    section = learning.page_section(open(PAGE).read())
    assert ("No runs yet" in section) == (not summary["runs"])
    if not summary["runs"]:
        assert not re.search(r"\d", section.replace(learning.BEGIN, "").replace(learning.END, ""))


def _fake_run(algo, contender, seed, final, seconds_to):
    points = [[2048, 10.0, [final - 500.0] * 5], [4096, 20.0, [final] * 10]]
    result = {"algo": algo, "contender": contender, "seed": seed, "frames": 4096, "updates": 640, "world_size": 1,
              "seconds": 30.0, "cpu_seconds": 29.0, "started": "x", "load_start": [1, 1, 1], "load_end": [1, 1, 1],
              "code_dirty": False, "threshold": final - 100.0, "points": points,
              "machine": {"git_head": "abc1234", "fabric_learner_dirty": False, "fabric_learner_sha256": "0" * 16}}
    result.update(learning.measures(result))
    result["seconds_to_threshold"] = seconds_to
    return result


def test_a_page_showing_a_number_not_in_the_results_fails_the_check():
    runs = [_fake_run("ppo", c, s, 1500.0 + 10 * s + (c == "learner"), 100.0 + s) for c in ("torchrl", "learner")
            for s in (0, 1)]
    summary = json.loads(json.dumps(learning.summarize(runs)))
    page = f"# page\n\n{learning.render_section(summary)}\n"
    assert learning.check_page(page, summary) == []
    assert "1506" in page  # the mean of the learner's two final returns, 1501 and 1511
    assert learning.check_page(page.replace("1506", "1507"), summary)
    assert learning.check_page(page, learning.summarize([])), "a page with runs passed against a summary without"
    empty = f"# page\n\n{learning.render_section(learning.summarize([]))}\n"
    assert learning.check_page(empty, summary), "a 'no runs yet' page passed against a summary with runs"
    assert learning.check_page("# page without the markers\n", summary)


def test_the_measures_are_the_last_ten_episodes_and_the_first_batch_past_the_threshold():
    points = [[100, 1.0, []], [200, 2.0, [0.0] * 8], [300, 3.0, [10.0] * 4], [400, 4.0, [20.0]]]
    assert [round(p[2], 2) for p in learning.curve(points)] == [0.0, 4.0, 6.0]
    got = learning.measures({"points": points, "threshold": 5.0})
    assert got == {"episodes": 13, "final_return": 6.0, "seconds_to_threshold": 4.0, "frames_to_threshold": 400}
    assert learning.measures({"points": points, "threshold": 7.0})["seconds_to_threshold"] is None


def test_a_runs_seconds_and_cpu_are_the_sums_over_its_segments():
    segments = [{"seconds": 10.0, "cpu_seconds_by_rank": [9.0, 8.0]}, {"seconds": 5.0, "cpu_seconds_by_rank": [4.0, 3.0]}]
    assert learning.segment_totals(segments) == {"seconds": 15.0, "cpu_seconds": 24.0, "cpu_seconds_by_rank": [13.0, 11.0]}
    for path in sorted(learning.RESULTS_DIR.rglob("*.json")):
        if "partial" in path.relative_to(learning.RESULTS_DIR).parts:  # a stopped run's checkpoint, not a run
            continue
        run = json.load(open(path))
        totals = learning.segment_totals(run["segments"])
        assert run["cpu_seconds_by_rank"] == totals["cpu_seconds_by_rank"], f"{path}: CPU per rank is not its segments' sum"
        assert abs(run["seconds"] - totals["seconds"]) < 1e-6 and abs(run["cpu_seconds"] - totals["cpu_seconds"]) < 1e-6, path


def test_every_run_names_a_clean_commit_of_this_history_no_older_than_the_verdicts():
    page = open(PAGE).read()
    named = re.search(r"Written at commit `([0-9a-f]{7,40})`", page)
    assert named, "docs/results.md's verdicts name no commit"
    split = re.search(r"before any `ddp_split` run\*\* \(at `([0-9a-f]{7,40})`", page)
    assert split, "docs/results.md's third verdict names no commit"
    sac = re.search(r"SAC's learner runs count from `([0-9a-f]{7,40})`", page)
    assert sac, "docs/results.md names no commit from which SAC's learner runs count"
    for name, run in _stored_summary()["runs"].items():
        assert run["fabric_learner_dirty"] is False and run["code_dirty"] is False, (
            f"{name} ran on code that differed from {run['git_head']}: rerun it on a clean tree")
        ran_at = _commit(run["git_head"], name)
        stated = split if run["contender"] == "ddp_split" else named
        verdicts_at = _commit(stated.group(1), "the verdicts of docs/results.md")
        assert _git("merge-base", "--is-ancestor", verdicts_at, ran_at).returncode == 0, (
            f"{name} ran at {run['git_head']}, before its verdicts were stated ({stated.group(1)})")
        if run["algo"] == "sac" and run["contender"] != "torchrl":  # the recipe's warm-up reaches the buffer from there
            fixed_at = _commit(sac.group(1), "the SAC recipe's replay-buffer fix")
            assert _git("merge-base", "--is-ancestor", fixed_at, ran_at).returncode == 0, (
                f"{name} ran at {run['git_head']}, before SAC's learner runs count ({sac.group(1)}): move it to "
                "benchmarks/results/learning/superseded/ and rerun it")


def test_a_tiny_run_of_one_contender_writes_its_result_with_provenance():
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "learning.py"), "run", "--algo", "ppo", "--contender",
               "learner", "--seed", "0", "--frames", "2048", "--env", "Pendulum-v1", "--out-dir", out]
        harness.run_bounded(cmd, 120, "a 2048-frame PPO run on Pendulum")
        result = json.load(open(os.path.join(out, "ppo-learner-s0.json")))
    assert result["smoke"] is True and result["frames"] == 2048 and result["updates"] == 10 * 32
    assert result["episodes"] == 10  # Pendulum's episodes last 200 steps
    returns = [r for _, _, ended in result["points"] for r in ended]
    assert result["final_return"] == round(sum(returns[-10:]) / 10, 2)
    assert result["machine"]["git_head"] and result["machine"]["fabric_learner_sha256"]
    assert result["cpu_seconds"] > 0 and len(result["load_start"]) == len(result["load_end"]) == 3
    assert result["seconds"] >= result["points"][-1][1] > 0
    probe = result["segments"][0]["host_probe"]  # the host's speed, so runs of different sessions can be compared
    assert probe["torch_s"] > 0 and probe["mujoco_s"] > 0


def test_a_run_stopped_at_its_budget_continues_from_its_checkpoint_without_losing_a_batch():
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "learning.py"), "run", "--algo", "sac", "--contender",
               "learner", "--seed", "0", "--frames", "2000", "--init-random-frames", "3000", "--env", "Pendulum-v1",
               "--out-dir", out]
        first = harness.run_bounded([*cmd, "--max-hours", "0"], 120, "a SAC segment stopped at once", check=False)
        assert first.returncode == 3 and "Run the same command again to continue" in first.stdout, first.stdout[-2000:]
        partial = learning._partial_folder(Path(out), "sac-learner-s0")
        code = harness.read_json(partial / "run.json")
        assert code == {"git_head": harness.git_head(), "code_dirty": harness.git_dirty(*learning.CODE)}  # what ran
        stopped_at = harness.read_json(partial / "segments.json")[0]["frames_at_end"]
        harness.write_json(partial / "run.json", {**code, "git_head": "0000000"})  # as if it had run other code
        refused = harness.run_bounded(cmd, 60, "a continuation on other code", check=False)
        assert refused.returncode != 0 and "Nothing was run: check out 0000000" in refused.stdout
        assert harness.read_json(partial / "segments.json")[0]["frames_at_end"] == stopped_at
        harness.write_json(partial / "run.json", code)
        harness.run_bounded(cmd, 180, "the same SAC run continued")
        result = json.load(open(os.path.join(out, "sac-learner-s0.json")))
        assert not partial.exists()
    assert stopped_at == 1000 and len(result["segments"]) == 2  # stopped after the first of two batches
    assert [frames for frames, _, _ in result["points"]] == [1000, 2000]  # each batch once, none lost
    assert result["frames"] == 2000 and result["updates"] == 0  # all warm-up: the harness is tested, not SAC
    # continued, not started again: 8 environments take 125 steps a batch and start new episodes on resuming, so
    # none of Pendulum's 200-step episodes ends (a run started afresh for the 2000 frames would end 8)
    assert result["episodes"] == 0
    assert result["seconds"] == sum(segment["seconds"] for segment in result["segments"])


def test_a_shortened_run_may_not_write_where_the_page_reads():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "learning.py"), "run", "--algo", "ppo", "--contender",
           "torchrl", "--seed", "9", "--frames", "2048", "--out-dir", str(learning.RESULTS_DIR)]
    done = harness.run_bounded(cmd, 60, "a shortened run aimed at the results", check=False)
    assert done.returncode != 0 and "may not write into" in done.stdout
    assert not (learning.RESULTS_DIR / "ppo-torchrl-s9.json").exists()


def test_the_split_contender_runs_ppo_only_and_says_so_before_running():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "learning.py"), "run", "--algo", "sac", "--contender",
           "ddp_split", "--seed", "0", "--frames", "2000"]
    done = harness.run_bounded(cmd, 60, "a SAC run of the PPO-only contender", check=False)
    assert done.returncode != 0 and "has no SAC run; nothing was run" in done.stdout
    assert learning._all_runs() == 3 * (5 + 4)
