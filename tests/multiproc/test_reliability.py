"""Bad input and real faults end in clear errors on every rank, never a hang, never lost data."""

import re

import pytest
from launches import FAULT_LIMIT, assert_every_rank_reached_the_fatal_case
from multinode import REPO, launch

DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")
LIMIT = 240  # seconds; a hang fails the test instead of blocking CI


def test_bad_checkpoints_fail_on_every_rank(refusals):
    # (rides the refusals launch, tests/launches.py; each simulated node has its own output directory there, as
    # nodes with only local disks would)
    headers, node_dirs = refusals.headers, refusals.node_dirs
    ranks = assert_every_rank_reached_the_fatal_case(refusals)
    expected = {
        "missing_key": "tensor 'model.layers.0.self_attn.q_proj.weight' is missing from the checkpoint",
        "wrong_shape": "tensor 'model.layers.1.mlp.gate.weight' has shape (3, 3) in the checkpoint but the model "
                       "expects (8, 32)",
        "corrupt_file": "is truncated: it has",
        "missing_path": "model path '/nonexistent/model/dir' does not exist or is not a directory",
        "dtype_differs_on_node1": "is torch.bfloat16 on source rank 2 but torch.float32 in the receiving rank's model",
        # Each names the file, as safetensors' own checks would reject it.
        "overlapping_offsets": f"{headers['overlapping_offsets']}/model.safetensors is corrupt: tensor ",
        "reversed_offsets": f"{headers['reversed_offsets']}/model.safetensors is corrupt: tensor ",
        "unknown_dtype": f"{headers['unknown_dtype']}/model.safetensors is corrupt: tensor ",
        "shape_not_matching_bytes": f"{headers['shape_not_matching_bytes']}/model.safetensors is corrupt: tensor ",
        "invalid_config_json": f"{headers['invalid_config_json']}/config.json is not valid JSON (Expecting",
    }
    details = {"overlapping_offsets": "overlaps tensor", "reversed_offsets": "its end is before its begin",
               "unknown_dtype": "has dtype 'F33', which is not a safetensors dtype",
               "shape_not_matching_bytes": "which needs"}
    for rank, data in ranks.items():
        err = data["errors"]["output_dir_not_shared"]  # before training, the same error on every rank
        assert err["type"] == "OutputDirNotSharedError", (rank, err)
        node_dir = node_dirs[rank // 2]
        assert err["message"].startswith(f"output_dir {node_dir} is not shared by all ranks (rank(s) [0, 1] see only "
                                         "the files of rank(s) [0, 1]; rank(s) [2, 3] see only the files of rank(s) "
                                         "[2, 3]): on another node it is another disk"), err["message"]
        assert "need a shared filesystem" in err["message"] and "set output_dir to a directory on it" in err["message"]
        for case, text in expected.items():
            err = data["errors"][case]
            assert err is not None and err["type"] == "DistributedInitError", (rank, case, err)
            assert text in err["message"], (rank, case, err["message"])
            assert details.get(case, "") in err["message"], (rank, case, err["message"])
    # Loading problems name both sources (ranks 0 and 2); the dtype problem only node 1's source.
    assert "rank(s) [0, 2]" in ranks[1]["errors"]["missing_key"]["message"]
    assert "rank(s) [2]" in ranks[0]["errors"]["dtype_differs_on_node1"]["message"]


def _assert_everyone_stopped(result, limit=LIMIT):
    assert not result.timed_out, result.describe()
    assert all(rc not in (0, None) for rc in result.returncodes), result.describe()
    assert result.seconds < limit


def test_source_killed_mid_distribution(demo_model, tmp_path):
    result = launch("faults.py", ["--scenario", "kill_source_mid_transfer", "--model", demo_model],
                    tmp_path, timeout=LIMIT)
    _assert_everyone_stopped(result)
    ranks = result.rank_results()
    assert 2 not in ranks  # killed with SIGKILL: it wrote nothing
    # torchrun stops a node's remaining workers once one fails; every rank that got to report names rank 2.
    assert ranks and any(r in ranks for r in (0, 1)), result.describe()
    for data in ranks.values():
        assert data["error_type"] == "DistributedInitError", data
        assert "memory_efficient_init failed" in data["error"], data["error"]
        # Rank 2 is named among the ranks that did not report back (its node peer may be, too:
        # torchrun may have stopped it before it could report).
        named = re.search(r"rank\(s\) \[([0-9, ]+)\] did not report back", data["error"])
        assert named and 2 in [int(r) for r in named.group(1).split(",")], data["error"]


def test_verify_init_detects_a_corrupted_region(fault_batch):
    # (the last scenario of the fault batch, tests/launches.py: its error ends every rank)
    result = fault_batch.result
    _assert_everyone_stopped(result, FAULT_LIMIT)
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3]
    for data in ranks.values():
        assert data["error_type"] == "DistributedInitError"
        assert "verify_init: tensor 'model.embed_tokens.weight'" in data["error"]
        assert "on rank 3 has CRC32" in data["error"] and "its source rank 2 has" in data["error"]


def test_rank_killed_during_a_training_step(demo_model, tmp_path):
    result = launch("faults.py", ["--scenario", "kill_rank_in_training_step", "--model", demo_model,
                                  "--dataset", DATASET, "--output-dir", str(tmp_path / "out")], tmp_path / "l",
                    timeout=LIMIT)
    _assert_everyone_stopped(result)
    ranks = result.rank_results()
    assert 3 not in ranks and ranks, result.describe()
    for data in ranks.values():
        assert data["error_type"] == "TrainingAbortedError", data
        assert "step3 failed on rank" in data["error"]


@pytest.mark.parametrize("tuner", ["lora", "full"])
def test_killed_mid_save_keeps_previous_checkpoint_and_resume_uses_it(demo_model, tmp_path, tuner):
    from twinkle_strategy.checkpoint import latest_checkpoint

    out = tmp_path / "out"
    args = ["--model", demo_model, "--dataset", DATASET, "--output-dir", str(out)] + (["--full"] if tuner == "full"
                                                                                       else [])
    result = launch("faults.py", ["--scenario", "kill_during_save", *args], tmp_path / "l1", timeout=LIMIT)
    _assert_everyone_stopped(result)
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    assert not (out / "checkpoint-4").exists()
    assert latest_checkpoint(str(out)) == str(out / "checkpoint-2")
    resumed = launch("faults.py", ["--scenario", "resume", *args], tmp_path / "l2", timeout=LIMIT)
    assert resumed.ok(), resumed.describe()
    assert resumed.rank_results()[0]["start_step"] == 2
    weights = "adapter_model.safetensors" if tuner == "lora" else "model.safetensors"
    assert (out / "checkpoint-6" / weights).is_file()
    assert not list(out.glob("*.tmp"))


def test_save_pretrained_exists_under_its_name_only_when_complete(demo_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.checkpoint.directories import INCOMPLETE_MARKER
    from twinkle_strategy.checkpoint.reading import SafetensorsIndex
    from twinkle_strategy.errors import CheckpointError
    from twinkle_strategy.loading import checkpoint_files_problem
    from twinkle_strategy.sources.model_ids import resolve_model_path

    out = tmp_path / "out"
    result = launch("faults.py", ["--scenario", "kill_during_save_pretrained", "--model", demo_model,
                                  "--output-dir", str(out)], tmp_path / "l", nnodes=1, timeout=LIMIT)
    _assert_everyone_stopped(result)
    # Saved again into a directory holding a file of the user's: same files, the user's kept, nothing stale.
    saves = result.rank_results()[0]
    assert saves["second_save"] == {**saves["first_save"], "notes.txt": saves["second_save"]["notes.txt"]}
    assert AutoModelForCausalLM.from_pretrained(out / "model") is not None
    # Killed mid-save: nothing under the final name; the pending directory is refused by every loader.
    assert not (out / "fresh").exists()
    staging = out / "fresh.tmp"
    assert (staging / INCOMPLETE_MARKER).is_file()
    for load in (resolve_model_path, SafetensorsIndex.from_directory):
        with pytest.raises(CheckpointError, match=f"{re.escape(str(staging))} is an incomplete save"):
            load(str(staging))
    assert "is an incomplete save" in checkpoint_files_problem(str(staging))


@pytest.mark.parametrize("tuner", ["lora", "full"])
def test_disk_full_while_saving(fault_batch, tuner):
    from safetensors.torch import load_file

    # (a scenario of the fault batch, tests/launches.py: every rank raised the error, then went on to the next)
    key = f"disk_full_during_save_{tuner}"
    out = fault_batch.output_dir / key
    result = fault_batch.result
    _assert_everyone_stopped(result, FAULT_LIMIT)
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3], result.describe()
    for data in (ranks[rank]["scenarios"][key] for rank in ranks):
        assert data["error_type"] == "CheckpointSaveError", data
        assert data["error"].startswith("saving checkpoint-4 (model weights) failed on rank(s) [0]: rank 0: ")
        assert "File too large" in data["error"] and data["error"].endswith("previous checkpoints are untouched")
    weights = "adapter_model.safetensors" if tuner == "lora" else "model.safetensors"
    assert (out / "checkpoint-2" / weights).stat().st_size > 1024
    if tuner == "lora":
        assert load_file(out / "checkpoint-2" / "trainer_state" / "trainable.safetensors")
    assert not (out / "checkpoint-4").exists() and not (out / "checkpoint-4.tmp").exists()


def test_a_rank_failing_to_write_trainer_state_stops_every_rank_together(fault_batch):
    # Rank 1 fails while writing the optimizer state, then the trainable weights (expert LoRA, ep=2: some of
    # both are gathered to be written). Every rank must get CheckpointSaveError at once, not wait in a gather
    # for the 60 s collective timeout the worker sets. (The first scenario of the fault batch, tests/launches.py.)
    out = fault_batch.output_dir / "fail_trainer_state_writes"
    result = fault_batch.result
    assert not result.timed_out, result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3], result.describe()
    for rank, data in ranks.items():
        scenario = data["scenarios"]["fail_trainer_state_writes"]
        assert scenario["error_type"] is None, (rank, scenario)  # the scenario itself ran to its end
        for part in ("optimizer", "trainable"):
            save = scenario["result"]["saves"][part]
            assert save["error_type"] == "CheckpointSaveError", (rank, part, save)
            assert "failed on rank(s) [1]: rank 1: OSError: [Errno 5] injected I/O error" in save["error"], save
            assert save["seconds"] < 30, (rank, part, save)
    assert (out / "checkpoint-1" / "trainer_state.json").is_file()
    assert not (out / "checkpoint-2").exists() and not (out / "checkpoint-3").exists()
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize("override,message", [
    ("tuner.lora_dropout=0.1", "tuner.lora_dropout=0.1 cannot be used with tuner.target_parameters"),
    ("tuner.use_dora=true", "tuner.use_dora=true cannot be used with tuner.target_parameters"),
    ("tuner.lora_bias=true", "tuner.lora_bias=true cannot be used with tuner.target_parameters"),
    # (an unknown key: one line with the nearest one, issue 31)
    ("train.max_stepz=3", "unknown recipe key 'train.max_stepz' in train.max_stepz=3; did you mean train.max_steps?"),
])
def test_lora_options_the_expert_path_cannot_serve(override, message, tmp_path, capsys):
    from twinkle_strategy.train.cli import main

    code = main([str(REPO / "yaml" / "demo.yaml"), f"data.dataset={DATASET}", f"train.output_dir={tmp_path}/o",
                 override])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (tmp_path / "o").exists()


def test_hccl_defaults_are_set_only_when_unset(monkeypatch):
    from twinkle_strategy.distributed.runtime import HCCL_ENV_DEFAULTS, apply_backend_env_defaults

    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT", raising=False)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "77")
    applied = apply_backend_env_defaults("hccl")
    import os

    assert os.environ["HCCL_CONNECT_TIMEOUT"] == HCCL_ENV_DEFAULTS["HCCL_CONNECT_TIMEOUT"]
    assert os.environ["HCCL_EXEC_TIMEOUT"] == "77" and "HCCL_EXEC_TIMEOUT" not in applied
    assert apply_backend_env_defaults("gloo") == {}
