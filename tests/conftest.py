import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Folder -> marker. The swift tier's folder is not `swift/` (nor the vllm tier's `vllm/`): this folder is on sys.path (above), and a `swift/`
# in it would shadow ms-swift's own `swift` package (vLLM's `vllm`) for every test that imports it.
TIERS = {"unit": "unit", "multiproc": "multiproc", "swift_plugin": "swift", "vllm_engine": "vllm"}


import launch_log  # noqa: E402

pytest.register_assert_rewrite("parallel_workers")  # a plugin below, imported here first
import parallel_workers  # noqa: E402

# The shared launches (session fixtures several test files assert on) and the fixtures they build on.
pytest_plugins = ["launches", "swift_fixtures", "parallel_workers"]

# The launch budget: how many launches (tests/launch_log.py: a simulated-node run, a twinkle-sft or swift run, a
# one-process script) each tier may make when it runs in full. Start-up is most of the suite's time: a test that
# needs ranks rides a launch that exists (tests/launches.py's session fixtures) before it adds one. Raise a number
# only with a reason in the commit.
# vllm_engine: two trainer launches (test_vllm_sync.py: its engine processes; test_grpo_colocate.py: engines
# colocated in its ranks), each after a vllm_env.sh check; test_vllm_engine_adapters.py: one process, after its own
# vllm_env.sh check. unit: the torch-free subprocesses of test_structure.py and test_launch_budget.py.
# multiproc: the full run of stop 41 counted 110 (the launch table); then -6 (i36-fuse-cli: the fit check,
# demo_run's plan and the master-port refusal call twinkle-sft's main in the pytest process; the bad-rows and
# swift-style re-launch runs are one session launch) and +1 (test_preload_server.py's client cases, the fork
# server's own test): 105, with 2 of room.
# swift_plugin: 35 fused to 26 (issue 36: one process for the env check, for the swift-env PEFT loads, for the
# vision-language build and swift's flags, for the parse-time refusals, for the async-save comparison's
# training_args.bin), then 2 for the swift leg of one SP meaning (swift sft 2x2 and the HF leg's worker in swift's
# env): 28, with 1 of room. Issues 46-47 added three multiproc launches (LoRA on the experts at 2x2, the six usual
# mistakes, a clean exit, which must not be preloaded): 110; unit 3: the teardown test's fresh interpreter.
LAUNCH_BUDGET = {"unit": 3, "multiproc": 110, "swift_plugin": 29, "vllm_engine": 8}


def pytest_configure(config):
    if not parallel_workers.is_controller(config):  # pytest-xdist's controller starts workers, never a launch
        launch_log.install()


def pytest_collection_modifyitems(items):
    """Mark every test with its tier, the folder it lives in (pyproject.toml registers the markers): `-m unit`."""
    for item in items:
        tier = TIERS.get(item.path.parent.name)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    launch_log.current_test[0] = item.nodeid  # a session fixture's launches count for the test that first needs it
    yield


def _tiers_run_in_full(config) -> list[str]:
    """The tier folders this session ran whole: `pytest tests` or `pytest tests/<tier>`, nothing filtered."""
    opt = config.option
    if opt.keyword or opt.markexpr or getattr(opt, "deselect", None) or getattr(opt, "lf", False) \
            or getattr(opt, "collectonly", False) or opt.maxfail:
        return []
    here = os.path.dirname(os.path.abspath(__file__))
    tiers = []
    for arg in config.args:
        path = os.path.abspath(os.path.join(str(config.invocation_params.dir), arg))
        if path in (here, os.path.dirname(here)):  # tests/, or the repository (pytest with no path)
            tiers += list(TIERS)
        elif os.path.dirname(path) == here and os.path.basename(path) in TIERS:
            tiers.append(os.path.basename(path))
    return tiers


def _launches_by_tier() -> dict[str, int]:
    counts = dict.fromkeys(TIERS, 0)
    for launch in launch_log.LAUNCHES:
        parts = launch.test.split("::")[0].split("/")
        if len(parts) > 2 and parts[-2] in counts:
            counts[parts[-2]] += 1
    return counts


_over_budget: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    if parallel_workers.is_worker(session.config):
        return  # a pytest-xdist worker: the controller counts every worker's launches (tests/parallel_workers.py)
    counts = _launches_by_tier()
    for tier in _tiers_run_in_full(session.config):
        if counts[tier] > LAUNCH_BUDGET[tier]:
            _over_budget.append(f"launch budget: tests/{tier} made {counts[tier]} launches, over its budget of "
                                f"{LAUNCH_BUDGET[tier]} (tests/conftest.py LAUNCH_BUDGET); ride an existing launch "
                                f"(tests/launches.py) instead of adding one")
    if _over_budget and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if launch_log.LAUNCHES:
        terminalreporter.section("launches (tests/launch_log.py)")
        for line in launch_log.table_lines():
            terminalreporter.write_line(line)
    for line in _over_budget:
        terminalreporter.write_line(line, red=True)

from twinkle_strategy.testing.families import FAMILIES, LAYOUT_FAMILIES  # noqa: E402
from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint  # noqa: E402

# Checkpoints split into several files (with model.safetensors.index.json): a few tensors per file.
SHARD = "40KB"
# Directory name -> (family, extra arguments): what the streaming tests load, in the hub layout transformers writes.
LAYOUT_CHECKPOINTS = {
    "deepseek_v4": ("deepseek_v4", {}),
    "qwen3_5_moe_vl": ("qwen3_5_moe_vl", {}),
    "mixtral_sharded": ("mixtral", {"max_shard_size": SHARD}),
    "qwen2_moe_tied_sharded": ("qwen2_moe", {"max_shard_size": SHARD, "tie_word_embeddings": True}),
    "deepseek_v4_sharded": ("deepseek_v4", {"max_shard_size": SHARD}),
    "qwen3_5_moe_vl_sharded": ("qwen3_5_moe_vl", {"max_shard_size": SHARD}),
    # (2I != H: its hub layout stores experts transposed, and transformers tells the two apart by shape)
    "qwen3_vl_moe": ("qwen3_vl_moe", {"intermediate_size": 8}),
}
assert {family for family, _ in LAYOUT_CHECKPOINTS.values()} >= set(LAYOUT_FAMILIES)


# ACCELERATE_USE_CPU as the suite was started with (see _accelerate_device_as_started).
_ACCELERATE_USE_CPU_AT_START = os.environ.get("ACCELERATE_USE_CPU")


def _restore_accelerate_device() -> None:
    if _ACCELERATE_USE_CPU_AT_START is None:
        os.environ.pop("ACCELERATE_USE_CPU", None)
    else:
        os.environ["ACCELERATE_USE_CPU"] = _ACCELERATE_USE_CPU_AT_START


@pytest.fixture(autouse=True)
def _accelerate_device_as_started():
    """A strategy set up in this process on a CPU exports ACCELERATE_USE_CPU (as ``accelerate launch --cpu``
    does) for the rest of the process, a session fixture's included; a test's launches must not inherit it from
    an earlier one: it would change what a user's fresh process sees, and start later launches fresh instead of
    from the preloaded interpreter (tests/preload.py), whose environment they must match."""
    _restore_accelerate_device()
    yield
    _restore_accelerate_device()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Real safetensors checkpoints of the tiny MoE families, built once per pytest run (once_per_run)."""
    return parallel_workers.once_per_run(tmp_path_factory, "tiny_checkpoints",
                                         lambda: _tiny_checkpoints(tmp_path_factory.mktemp("tiny_ckpts")))


def _tiny_checkpoints(root):
    for family in FAMILIES:
        save_tiny_checkpoint(family, str(root / family), seed=0)
    # Tied input/output embeddings: must stay one tensor after init.
    save_tiny_checkpoint("qwen3_moe", str(root / "qwen3_moe_tied"), seed=1, tie_word_embeddings=True)
    for name, (family, kwargs) in LAYOUT_CHECKPOINTS.items():
        save_tiny_checkpoint(family, str(root / name), seed=2, **kwargs)
    return root


@pytest.fixture(scope="session")
def wrong_shape_checkpoint(tiny_checkpoints, tmp_path_factory):
    """The tiny Qwen3-MoE checkpoint with one tensor of the wrong shape."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("wrong_shape") / "qwen3_moe"
    shutil.copytree(tiny_checkpoints / "qwen3_moe", path)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.1.mlp.gate.weight"] = torch.zeros(3, 3)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
