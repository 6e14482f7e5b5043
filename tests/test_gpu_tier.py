"""The GPU tier (``make test-gpu``) proven on the CPU until a GPU is lent: its collection, its report, its skip
reasons, and every check passing in a dry run with the CPU as the device (benchmarks/gpu_tier.py --dry-run)."""

from __future__ import annotations

import ast
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
CHECKS = os.path.join(ROOT, "tests", "gpu", "cuda_checks.py")
# what the issue lists, each by the check that answers it
LISTED = {
    "an update on the device equal to the CPU's: DQN, PPO": "test_an_update_on_the_device_equals_the_cpu_update",
    "SAC with stages": "test_sac_with_stages_on_the_device_equals_the_cpu_update",
    "GRPO": "test_grpo_on_the_device_equals_the_cpu_update",
    "bf16-mixed, bf16-true, 16-mixed with its scaler":
        "test_a_low_precision_update_on_the_device_stays_near_the_float32_cpu_update",
    "FSDP2 on one rank, per-layer units": "test_fsdp2_with_a_unit_per_layer_on_the_device_equals_the_cpu_update",
    "FSDP2 per-decoder-layer units, activation checkpointing, mixed-precision policy":
        "test_fsdp2_decoder_units_with_activation_checkpointing_and_bf16_policy_stay_near_the_cpu_update",
    "a checkpoint from the device on the CPU and back, sharded and unsharded":
        "test_a_checkpoint_written_on_the_device_loads_on_the_cpu_and_back",
    "get_weights with and without cpu_offload": "test_get_weights_from_the_device_equal_the_cpu_weights",
    "the update step against a hand-written loop": "test_the_update_on_the_device_against_a_hand_written_loop_interleaved",
    "GRPO tokens/s against hand FSDP2 on one rank": "test_grpo_tokens_per_second_on_the_device_against_hand_fsdp2_on_one_rank",
    "multi-rank NCCL": "test_two_cuda_ranks_under_nccl_equal_one_cpu_process_on_the_full_batch",
}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of the whole tier in a fresh interpreter, as `make test-gpu` runs it; its report."""
    import harness

    report = tmp_path_factory.mktemp("tier") / "gpu_tier.json"
    done = harness.run_bounded([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_tier.py"), "--dry-run",
                                "--report", str(report)], 400, "the GPU tier's dry run", check=False)
    assert report.exists(), done.stdout[-4000:]
    return done, json.loads(report.read_text())


def test_the_tier_holds_a_check_for_every_cuda_check_the_issue_lists():
    defined = {node.name for node in ast.parse(open(CHECKS).read()).body if isinstance(node, ast.FunctionDef)}
    assert not {what: name for what, name in LISTED.items() if name not in defined}


def test_every_check_passes_on_the_cpu_as_the_device_and_only_cuda_only_checks_are_skipped(dry_run):
    done, report = dry_run
    failed = {name: check.get("error", "")[-800:] for name, check in report["checks"].items()
              if check["outcome"] == "failed"}
    assert not failed and done.returncode == 0, (failed, done.stdout[-3000:])
    skipped = {name: check["reason"] for name, check in report["checks"].items() if check["outcome"] == "skipped"}
    assert skipped == {
        "test_a_low_precision_update_on_the_device_stays_near_the_float32_cpu_update[16-mixed]":
            "fp16 autocast with a GradScaler is CUDA's: Fabric refuses 16-mixed on CPU",
        "test_two_cuda_ranks_under_nccl_equal_one_cpu_process_on_the_full_batch[ddp]":
            "multi-rank NCCL needs 2 CUDA devices; torch.cuda.device_count() = 0",
        "test_two_cuda_ranks_under_nccl_equal_one_cpu_process_on_the_full_batch[fsdp]":
            "multi-rank NCCL needs 2 CUDA devices; torch.cuda.device_count() = 0",
    }
    ran = {name.split("[")[0] for name in report["checks"]}
    assert ran == set(LISTED.values())
    assert report["counts"] == {"passed": len(report["checks"]) - 3, "failed": 0, "skipped": 3}


def test_the_report_names_the_device_the_versions_and_each_checks_figures(dry_run):
    _, report = dry_run
    device = report["device"]
    assert device["tier_device"] == "cpu" and device["name"] == "cpu (dry run)"
    assert device["torch"] == torch.__version__ and device["cuda"] == torch.version.cuda
    assert report["machine"]["torchrl"] and report["machine"]["git_head"]
    checks = report["checks"]
    speed = checks["test_the_update_on_the_device_against_a_hand_written_loop_interleaved"]["figures"]
    assert speed["ratio_learner_over_hand"] > 0 and len(speed["ci95"]) == 2 and speed["verdict_goal_1.05"]
    tokens = checks["test_grpo_tokens_per_second_on_the_device_against_hand_fsdp2_on_one_rank"]["figures"]
    assert set(tokens["tokens_per_s"]) == {"learner", "hand"} and tokens["tokens_per_s_learner_over_hand"] > 0
    gaps = [c["figures"]["max_abs_gap"] for c in checks.values() if "max_abs_gap" in c["figures"]]
    assert len(gaps) >= 8 and all(g >= 0 for g in gaps)
    assert report["exit_status"] == 0 and sum(report["counts"].values()) == len(checks)  # the last write: complete


def test_the_tier_rewrites_its_report_after_each_check_so_a_cut_off_run_leaves_what_it_checked():
    import gpu_tier

    class Logged:
        def __init__(self, nodeid, when, outcome):
            self.nodeid, self.when, self.duration, self.user_properties = nodeid, when, 0.5, []
            self.passed, self.skipped, self.failed = outcome == "passed", outcome == "skipped", outcome == "failed"
            self.longrepr = "boom"

    seen = []
    report = gpu_tier.Report(on_change=lambda: seen.append({k: v["outcome"] for k, v in report.checks.items()}))
    for nodeid, when, outcome in [("test_a", "setup", "passed"), ("test_a", "call", "passed"),
                                  ("test_a", "teardown", "passed"), ("test_b", "setup", "passed"),
                                  ("test_b", "call", "failed")]:
        report.pytest_runtest_logreport(Logged(f"cuda_checks.py::{nodeid}", when, outcome))
    assert seen == [{"test_a": "running"}, {"test_a": "passed"}, {"test_a": "passed"},
                    {"test_a": "passed", "test_b": "running"}, {"test_a": "passed", "test_b": "failed"}]


def test_without_cuda_the_tier_refuses_and_writes_no_report(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the tier runs here")
    import gpu_tier

    report = tmp_path / "gpu_tier.json"
    assert gpu_tier.main(["--report", str(report)]) == 2
    assert "no CUDA device here" in capsys.readouterr().err and not report.exists()


def test_the_cores_tier_refuses_where_cores_are_too_few():
    import cores

    assert cores.refusal(cores.MIN_CORES) is None
    line = cores.refusal(2)
    assert line.startswith("make test-cores: this machine has 2 cores; these checks need at least 4")


def test_parts_the_cores_budget_leaves_no_time_for_are_recorded_as_not_run_and_fail_nothing(tmp_path, monkeypatch):
    import cores

    monkeypatch.setattr(cores, "refusal", lambda cores_here: None)
    report = tmp_path / "cores.json"
    assert cores.main(["--parts", ",".join(cores.PARTS), "--budget", "0", "--report", str(report)]) == 0
    written = json.loads(report.read_text())
    assert all(written[part]["not_run"] == "0 s of the --budget 0 s left" for part in cores.PARTS)
    assert all(written[part]["part_seconds"] < 1 for part in cores.PARTS)  # nothing was launched


def test_a_failure_anywhere_in_a_part_fails_the_cores_tier_and_a_skip_does_not():
    import cores

    assert cores.failed({"ppo": {"ratio": 1.0}, "dqn": {"failed": "exit 1"}})
    assert cores.failed({"seconds": 400.0, "exit_status": 1})
    assert not cores.failed({"skipped": "Ray is not installed here"})
    assert not cores.failed({"ppo": {"timed_out_after_s": 40.0}, "dqn": {"not_run": "0 s of the part's 40 s left"}})
    assert not cores.failed({"ppo": {"not_run": "10 s of the part's 360 s left"}, "seconds": 1, "exit_status": 0})


def test_a_run_past_its_bound_records_the_bound_and_a_run_that_errs_records_its_failure():
    import cores

    assert cores.bounded([sys.executable, "-c", "pass"], 60, "a run") is None
    cut = cores.bounded([sys.executable, "-c", "import time; time.sleep(30)"], 1, "a sleeper")
    assert cut["timed_out_after_s"] == 1 and not cores.failed(cut)
    erred = cores.bounded([sys.executable, "-c", "raise SystemExit(3)"], 60, "a failing run")
    assert "a failing run failed (exit 3)" in erred["failed"] and cores.failed(erred)


def test_rays_pack_keeps_its_binaries_executable_and_leaves_out_the_libraries_not_used(tmp_path):
    import tarfile
    import zipfile

    import gpu_tier

    wheel = tmp_path / "ray-0-cp312-cp312-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, mode in [("ray/__init__.py", 0o644), ("ray/core/src/ray/raylet/raylet", 0o755),
                           ("ray/rllib/algorithm.py", 0o644), ("ray/jars/ray_dist.jar", 0o644),
                           ("ray/dashboard/client/build/main.js", 0o644), ("ray/dashboard/agent.py", 0o644)]:
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = mode << 16
            zf.writestr(info, b"x" * 100)
    out = tmp_path / "ray.tar.xz"
    assert gpu_tier.pack_ray(str(wheel), str(out)) == out.stat().st_size
    with tarfile.open(out) as tar:
        modes = {m.name: m.mode for m in tar.getmembers()}
    assert modes == {"ray/__init__.py": 0o644, "ray/core/src/ray/raylet/raylet": 0o755, "ray/dashboard/agent.py": 0o644}
