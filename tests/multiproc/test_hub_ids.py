"""hf:// and ms:// ids resolve offline, from local caches laid out as huggingface_hub and modelscope lay them out,
through those clients; with memory_efficient_init only each node's source opens anything in them. A bare org/name
goes where swift sends it in twinkle-sft: ModelScope, or the Hugging Face Hub with --use_hf true / USE_HF=1; in Python
(the library, HF Trainer and TRL scripts) where transformers sends it: the Hugging Face Hub."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from multinode import REPO, launch

DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")
REPO_ID = "twinkle/tiny-moe"
NO_WEIGHTS_ID = "twinkle/no-weights"
COMMIT = hashlib.sha1(b"twinkle tiny-moe").hexdigest()


def populate_hf_cache(model_dir: Path, hf_home: Path, repo_id: str) -> Path:
    """The huggingface_hub cache layout: blobs named by content hash, a snapshot of relative symlinks, refs/main."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for d in (repo / "blobs", snapshot, repo / "refs"):
        d.mkdir(parents=True)
    for file in sorted(model_dir.iterdir()):
        data = file.read_bytes()
        if file.suffix == ".safetensors":  # an LFS file: its sha256
            blob = hashlib.sha256(data).hexdigest()
        else:  # a regular git file: its git blob id
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def populate_modelscope_cache(model_dir: Path, cache: Path, repo_id: str, files=None) -> Path:
    """The modelscope cache layout (modelscope-hub): models/<owner>--<name>/snapshots/master/<files>."""
    snapshot = cache / "models" / repo_id.replace("/", "--") / "snapshots" / "master"
    snapshot.mkdir(parents=True)
    for file in sorted(model_dir.iterdir()):
        if files is None or file.name in files:
            shutil.copy(file, snapshot / file.name)
    return snapshot


@pytest.fixture(scope="module")
def hub_caches(tmp_path_factory):
    from huggingface_hub import scan_cache_dir, snapshot_download

    from twinkle_strategy.train.demo_model import prepare_demo_model

    root = tmp_path_factory.mktemp("hubs")
    model = Path(prepare_demo_model(str(root / "model"), DATASET))
    hf_snapshot = populate_hf_cache(model, root / "hf", REPO_ID)
    ms_snapshot = populate_modelscope_cache(model, root / "ms", REPO_ID)
    populate_modelscope_cache(model, root / "ms", NO_WEIGHTS_ID, files={"config.json"})
    # The clients themselves read these layouts back, without network.
    cached = scan_cache_dir(root / "hf" / "hub")
    assert [(r.repo_id, r.nb_files) for r in cached.repos] == [(REPO_ID, len(list(model.iterdir())))]
    assert snapshot_download(REPO_ID, cache_dir=root / "hf" / "hub", local_files_only=True) == str(hf_snapshot)
    return root, hf_snapshot, ms_snapshot


def test_hub_ids_train_offline_and_only_sources_open_the_caches(hub_caches, tmp_path):
    root, hf_snapshot, ms_snapshot = hub_caches
    env = {"HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "MODELSCOPE_CACHE": str(root / "ms")}
    ids = [f"hf://{REPO_ID}", REPO_ID]  # the bare id: ModelScope's cache, as swift takes it
    result = launch("hub_ids.py", ["--recipe", str(REPO / "yaml" / "demo.yaml"), "--dataset", DATASET,
                                   "--output-dir", str(tmp_path / "out"), "--ids", *ids,
                                   "--not-loadable", NO_WEIGHTS_ID],
                    tmp_path / "launch", nnodes=2, nproc_per_node=2, timeout=600, env=env)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3]
    snapshots = {ids[0]: str(hf_snapshot), ids[1]: str(ms_snapshot)}
    for model_id, snapshot in snapshots.items():
        losses = ranks[0]["runs"][model_id]["losses"]
        for rank, data in ranks.items():
            run = data["runs"][model_id]
            assert run["losses"] == losses  # one run, trained together
            assert run["connections"] == [], (rank, model_id, run["connections"])  # offline: no Python socket
            if rank in (0, 2):  # each node's source resolves the id and reads the weights, from the snapshot
                opened = {os.path.relpath(p, snapshot) for p in run["opened"]}
                assert {"config.json", "model.safetensors", "tokenizer.json"} <= opened, (rank, run["opened"])
            else:  # the others get config and tokenizer from their source: they open nothing in the caches
                assert run["opened"] == [], (rank, model_id, run["opened"])
    refusal = ranks[0]["refused"][NO_WEIGHTS_ID]
    assert refusal is not None and refusal.startswith(f"model.path: the cached snapshot of ms://{NO_WEIGHTS_ID}: ")
    assert "has no safetensors weights" in refusal


def test_bare_ids_go_to_swifts_hub(tmp_path, monkeypatch):
    """ms-swift 4.6 (``swift.hub.get_hub``, ``safe_snapshot_download``): an existing local path wins; otherwise a
    bare org/name comes from ModelScope, or from the Hugging Face Hub with --use_hf true, or USE_HF=1 when the
    flag is not given."""
    from twinkle_strategy.sources.model_ids import Hub, hub_for_bare_ids, qualified_model_id
    from twinkle_strategy.train.cli import parse

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("USE_HF", raising=False)
    base = [str(REPO / "yaml" / "demo.yaml"), f"data.dataset={DATASET}"]
    assert parse([*base, "--model", "Qwen/Qwen3-30B-A3B"]).model.path == "ms://Qwen/Qwen3-30B-A3B"
    assert parse([*base, "--model", "Qwen/Qwen3-30B-A3B", "--use_hf", "true"]).model.path == "hf://Qwen/Qwen3-30B-A3B"
    assert parse([*base, "model.path=Qwen/Qwen3-30B-A3B", "model.use_hf=true"]).model.path == \
        "hf://Qwen/Qwen3-30B-A3B"
    monkeypatch.setenv("USE_HF", "1")
    assert hub_for_bare_ids() is Hub.HUGGING_FACE
    assert parse([*base, "--model", "Qwen/Qwen3-30B-A3B"]).model.path == "hf://Qwen/Qwen3-30B-A3B"
    assert parse([*base, "--model", "Qwen/Qwen3-30B-A3B", "--use_hf", "false"]).model.path == \
        "ms://Qwen/Qwen3-30B-A3B"  # the flag wins over the environment, as in swift
    # Left as they are: prefixed ids, the embedded model, paths, and a local directory spelled like an id.
    (tmp_path / "Qwen" / "Qwen3-30B-A3B").mkdir(parents=True)
    for kept in ("Qwen/Qwen3-30B-A3B", "ms://Qwen/Qwen3-30B-A3B", "tiny://demo", "/models/Qwen3", "./Qwen3-30B-A3B",
                 "Qwen3-30B-A3B", "a/b/c"):
        assert qualified_model_id(kept, use_hf=True) == kept, kept


def test_a_bare_id_the_hub_cannot_give_is_one_line(tmp_path, monkeypatch, capsys):
    """Offline, before launch (HF_HUB_OFFLINE=1, not in the cache), and unreachable, in the run (ModelScope at a
    closed port: what a machine without network sees, without using the network): one line each, naming the hub
    and the way to the other one."""
    from twinkle_strategy.train.cli import main
    from twinkle_strategy.train.launcher import free_port

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    code = main([str(REPO / "yaml" / "demo.yaml"), f"data.dataset={DATASET}", "--model", "twinkle/not-cached",
                 "--use_hf", "true"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("twinkle-sft: error: model.path (--model): hf://twinkle/not-cached is not in the Hugging "
                          "Face cache"), err
    assert list(tmp_path.iterdir()) == []
    env = {**os.environ, "MODELSCOPE_ENDPOINT": f"http://127.0.0.1:{free_port()}", "MODELSCOPE_API_MAX_RETRIES": "1",
           "MODELSCOPE_REPO_TREE_PAGE_RETRY_MAX_DELAY_SECONDS": "1", "MODELSCOPE_CACHE": str(tmp_path / "ms"),
           "USE_HF": "0"}
    # The same failure in each front-end's words: twinkle-sft's flags (its recipe made the bare id ms://), and
    # the Python argument for a library user, who has no --use_hf.
    code = ("from twinkle_strategy.errors import CheckpointError\n"
            "from twinkle_strategy.sources.model_ids import resolve_model_path\n"
            "from twinkle_strategy.train.recipe import command_line_hubs\n"
            "for hubs in ({'hubs': command_line_hubs(None)}, {}):\n"
            "    try:\n        resolve_model_path('ms://twinkle/not-cached', **hubs)\n"
            "    except CheckpointError as exc:\n        print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("\n") == 2, proc
    twinkle_sft, python = proc.stdout.splitlines()
    for line in (twinkle_sft, python):
        assert line.startswith("could not get ms://twinkle/not-cached from ModelScope: NetworkError: "), line
    assert twinkle_sft.endswith("check the id and the network, or take it from the Hugging Face Hub (--model "
                                "hf://twinkle/not-cached, or --use_hf true (USE_HF=1) for a bare id), or pass a local "
                                "checkpoint directory"), twinkle_sft
    assert python.endswith("check the id and the network, or take it from the Hugging Face Hub (pass "
                           "'twinkle/not-cached' or 'hf://twinkle/not-cached'), or pass a local checkpoint "
                           "directory"), python


def test_in_python_a_bare_id_is_the_hugging_face_hubs(hub_caches, tmp_path):
    """The library (what a transformers or TRL script calls) takes a bare org/name as transformers does: from the
    Hugging Face Hub through huggingface_hub, its cache and HF_HUB_OFFLINE, never from ModelScope, whatever USE_HF
    says (swift's variable). Not cached and offline: one line at once, in Python's words, and nothing written.
    (A subprocess: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported.)"""
    root, hf_snapshot, _ = hub_caches
    env = {**os.environ, "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "USE_HF": "0",
           "MODELSCOPE_CACHE": str(tmp_path / "ms")}
    code = ("import json, time\n"
            "from twinkle_strategy.errors import CheckpointError\n"
            "from twinkle_strategy.sources.model_ids import resolve_model_path\n"
            f"found = resolve_model_path({REPO_ID!r})\n"
            "started = time.monotonic()\n"
            "try:\n    resolve_model_path('twinkle/not-cached')\n"
            "except CheckpointError as exc:\n    message = str(exc)\n"
            "print(json.dumps([found, message, time.monotonic() - started]))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc
    found, message, seconds = json.loads(proc.stdout.splitlines()[-1])
    assert found == str(hf_snapshot)
    assert seconds < 10  # the run waited 28.8 s for ModelScope's DNS
    assert message.startswith("could not get hf://twinkle/not-cached from the Hugging Face Hub: ") and \
        "\n" not in message, message
    assert message.endswith("or take it from ModelScope (pass 'ms://twinkle/not-cached'), or pass a local checkpoint "
                            "directory"), message
    assert "--use_hf" not in message
    assert not (tmp_path / "ms").exists()  # modelscope was never asked
