"""hf:// and ms:// ids resolve offline, from local caches laid out as huggingface_hub and modelscope lay them out,
through those clients; with memory_efficient_init only each node's source opens anything in them."""

import hashlib
import os
import shutil
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
    ids = [f"hf://{REPO_ID}", f"ms://{REPO_ID}"]
    result = launch("hub_ids.py", ["--recipe", str(REPO / "yaml" / "demo.yaml"), "--dataset", DATASET,
                                   "--output-dir", str(tmp_path / "out"), "--ids", *ids,
                                   "--not-loadable", f"ms://{NO_WEIGHTS_ID}"],
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
    refusal = ranks[0]["refused"][f"ms://{NO_WEIGHTS_ID}"]
    assert refusal is not None and refusal.startswith(f"model.path: the cached snapshot of ms://{NO_WEIGHTS_ID}: ")
    assert "has no safetensors weights" in refusal
