"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import pooled_ranks
from mfsdp import launch as _launch_module

ROOT = Path(__file__).resolve().parents[1]

# The tests' ranks are kept from one launch to the next (tests/pooled_ranks.py says how and
# what is reset between calls); set before the test modules import `launch`.
_launch_module.launch = pooled_ranks.pooled_launch


@pytest.fixture(autouse=True)
def _kept_ranks(request):
    """Fresh ranks for the tests of ``launch`` itself and for tests marked ``fresh_ranks``."""
    fresh = (request.node.get_closest_marker("fresh_ranks") is not None
             or request.node.path.name == "test_launch.py")
    pooled_ranks.enabled = not fresh
    yield
    pooled_ranks.enabled = True


def pytest_sessionfinish(session, exitstatus):
    pooled_ranks.close_all()


def pytest_terminal_summary(terminalreporter):
    s = pooled_ranks.stats
    if s["pooled"] or s["fresh"]:
        terminalreporter.write_line(
            f"launches: {s['pooled']} in kept ranks ({s['reruns']} run again in fresh ranks "
            f"after failing in kept ones), {s['fresh']} in fresh ranks")
        for line in pooled_ranks.reruns:
            terminalreporter.write_line(f"  run again in fresh ranks: {line}")

# Scripts run as programs by the tests (under torchrun), not imported: --doctest-modules would
# import them and start their code.
collect_ignore_glob = ["upstream/*.py", "fixtures/*/*.py"]  # scripts run by others, not tests


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """Build the guide once per session with ``-W --keep-going`` (offline) and return the HTML dir."""
    out = ROOT / "build" / "test-html"
    env = dict(os.environ, MFSDP_DOCS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q", "-E",
         str(ROOT), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"docs build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return out


def skip_or_fail(reason: str) -> None:
    """Skip with ``reason`` on a developer machine; fail in CI (``CI=true``), where it must run."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)


# `make test`'s 25-minute budget on a 2-core machine. These parametrized multi-rank cross-checks
# run one case in every STRIDE of their parametrization in `make test` (so every strategy,
# optimizer and size still appears in some case) and every case in `make test-extended`, which CI
# also runs: test name -> stride.
SAMPLED = {
    "test_matches_single_process_reference": 8,          # test_engine.py: 48 cases
    "test_gradient_accumulation_equals_one_large_batch": 3,  # test_engine.py: 26
    "test_four_ranks_match_reference": 3,                # test_hsdp_ep.py: 18
    "test_dispatcher_matches_dense_reference": 3,        # test_moe.py: 18
    "test_torchrun_two_ranks_lowers_the_loss": 2,        # test_train.py: 5 torchrun jobs
    "test_dense_layouts_give_the_single_process_loss_curve": 2,  # test_train.py: 4
    "test_moe_layouts_give_the_single_process_loss_curve": 2,    # test_train.py: 4
    "test_state_memory_matches_strategy_table": 2,       # test_engine_memory.py: 8
}


# Single cases moved to `make test-extended` for `make test`'s budget; a sibling case of each
# stays in `make test` (another strategy; the other two checkpointing flavours; SGD).
EXTENDED_CASES = {
    "tests/test_checkpoint.py::test_resume_is_bit_identical[optim]",
    "tests/test_checkpoint.py::test_resume_is_bit_identical[no_shard]",
    # resharding 2 -> 4 ranks (4 -> 2 and 4 -> HSDP on 4 are extended too)
    "tests/test_checkpoint.py::test_reshard_keeps_state_and_training[2to4]",
    "tests/test_backward_idioms.py::"
    "test_activation_checkpointing_neither_regathers_nor_reshards[no-early-stop]",
    "tests/test_context_parallel.py::test_context_parallel_matches_one_process[cp2-tp2-sp-adamw]",
    # the DDP engine's fused AdamW (mfsdp's stays), the double buffer's timeline (its own
    # storage's stays)
    "tests/test_train_speed.py::"
    "test_fused_adam_builds_a_fused_adamw_that_trains_as_the_unfused_one[ddp]",
    "tests/test_memory_timeline.py::"
    "test_timeline_equals_the_engine_counters_after_every_event[double-buffer]",
    # EP with an outer optim shard (the ZeRO-3 and ZeRO-2 resumes stay; the trainer resumes EP 2
    # from Megatron-LM); FSDP -> HSDP resharding (the trainer's resume on another layout stays)
    "tests/test_checkpoint.py::"
    "test_resume_is_bit_identical[optim_grads_params-ep2-dp_outer2-outer_strategyoptim]",
    "tests/test_checkpoint.py::test_reshard_keeps_state_and_training[fsdp_to_hsdp]",
    # two of the six damaged checkpoints (a missing key and a zeroed file stay)
    "tests/test_checkpoint.py::test_corrupt_checkpoints_fail_with_a_message"
    "[unexpected-has unexpected key 'model.blocks.3.fc1.bias']",
    "tests/test_checkpoint.py::test_corrupt_checkpoints_fail_with_a_message"
    "[truncated-is truncated or was modified]",
    # the trainer: Llama TP 2 + SP (MoE with MLA, CP 2, EP 2 stays; test_tensor_parallel.py runs
    # Llama's TP plan); the torch_dist EP 2 save and load (fsdp_dtensor's stays)
    "tests/test_train.py::test_tensor_parallel_layouts_give_the_single_process_loss_curve"
    "[llama-tp2-sp]",
    "tests/test_train.py::test_save_then_load_continues_the_run[torch_dist-ep2]",
    # the no_shard sibling of a strategy pair (optim's stays), a third one-line user error
    "tests/test_idioms.py::test_pytorch_idioms_under_hsdp_and_hfsdp[no_shard]",
    "tests/test_engine_arguments.py::test_hybrid_groups_are_used_or_refused[no_shard]",
    "tests/test_plan.py::test_tensor_parallel_state_bytes_match_measured[optim]",
    "tests/test_reliability.py::test_a_user_error_is_one_line_printed_once[load-a-file]",
    # ZeRO-3's bit-identical resume (ZeRO-2's stays; the trainer saves and loads ZeRO-3), the
    # Llama half of the Megatron TP plan pair (MoE with SGD stays; Llama's own TP plan stays),
    # the trainer's TP vocabulary padding (the vocab-parallel loss stays), a resume with nothing
    # left to train, and the direct Megatron-LM --load (the five --load-from-saved-arguments
    # tests of test_megatron_lm_resume.py stay)
    "tests/test_checkpoint.py::test_resume_is_bit_identical[optim_grads_params]",
    "tests/test_tensor_parallel.py::"
    "test_mfsdp_gpt_with_megatron_tp_plan_matches_one_process[llama-True-adamw]",
    "tests/test_train.py::test_vocabulary_is_padded_for_tensor_parallelism_as_megatron_lm_pads",
    "tests/test_train.py::test_a_resume_with_nothing_to_train_says_so_and_trains_nothing",
    "tests/test_megatron_lm_checkpoints.py::test_trainer_resumes_a_megatron_lm_checkpoint",
}


@pytest.hookimpl(tryfirst=True)  # before `-m 'not extended'` deselects
def pytest_collection_modifyitems(config, items):
    """Mark all but one case in every ``SAMPLED`` stride of cases as extended, and the
    ``EXTENDED_CASES``."""
    seen: Counter = Counter()
    for item in items:
        if item.nodeid in EXTENDED_CASES:
            item.add_marker(pytest.mark.extended)
        name = getattr(item, "originalname", None)
        stride = SAMPLED.get(name)
        if stride is None:
            continue
        key = (item.module.__name__ if getattr(item, "module", None) else "", name)
        n = seen[key]
        # a diagonal through the strides (0, stride + 1, 2 * stride + 2, ...), so that the
        # innermost parameter does not repeat one value in every kept case
        if n % stride != (n // stride) % stride:
            item.add_marker(pytest.mark.extended)
        seen[key] += 1
