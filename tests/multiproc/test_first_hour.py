"""What a newcomer meets in the first hour agrees with what runs (issue 31 point 5): ``--help`` after a recipe,
``--version``, the versions the docs and scripts name, the expert-load heatmap's labels."""

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from multinode import REPO

DEMO = str(REPO / "yaml" / "demo.yaml")
DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")


def pins(constraints: str) -> dict[str, str]:
    lines = (REPO / constraints).read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if "==" in line and not line.startswith("#"))


def test_help_after_a_recipe_shows_its_values_and_every_flag_a_real_help_line(capsys):
    from twinkle_strategy.train.cli import SWIFT_FLAGS, build_parser, main

    try:
        main([DEMO, "train.max_steps=7", "--help", "--learning-rate", "0.002"])
    except SystemExit as exc:
        assert exc.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    # The recipe's values, with this command's settings: not the built-in defaults (max_steps -1, lr 0.0001).
    assert "--max_steps V optimizer steps to train; > 0 overrides num_train_epochs (demo.yaml: 7) " \
           "[train.max_steps]" in text, text
    assert "(demo.yaml: 0.002) [train.learning_rate]" in text and "(demo.yaml: 2) [strategy.ep_size]" in text
    assert "(demo.yaml: [q_proj, k_proj, v_proj, o_proj]) [tuner.target_modules]" in text
    # Without a recipe: the defaults, named as such.
    assert "(default: -1) [train.max_steps]" in " ".join(build_parser().format_help().split())
    for flag, (key, help_line) in SWIFT_FLAGS.items():
        assert len(help_line) > 8 and "training argument" not in help_line, (flag, help_line)
        assert f"[{key}]" in text, flag


def test_version_names_the_installed_the_declared_and_the_tested_versions():
    """``twinkle-sft --version``: the installed torch/transformers/peft, setup.py's declared ranges and the versions
    the suite runs on, which docs/versions.md's table states (the numbers are checked, not the prose); then the
    HF Trainer / TRL front-end's trl and accelerate (issue 35)."""
    from twinkle_strategy.train.versions import TESTED_VERSIONS

    cli = REPO / ".venv" / "bin" / "twinkle-sft"
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "twinkle_strategy.train.cli"]
    proc = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc
    lines = proc.stdout.splitlines()
    assert lines[0] == "twinkle-sft 0.1.0"
    setup = (REPO / "setup.py").read_text()
    table = (REPO / "docs" / "versions.md").read_text()
    # The HF Trainer / TRL front-end's packages after them: trl with its range (setup.py's test extra), accelerate.
    assert lines[4:] == [f"  trl {metadata.version('trl')} (HF Trainer / TRL front-end; declared trl<2,>=1.16)",
                         f"  accelerate {metadata.version('accelerate')} (HF Trainer / TRL front-end; its range is the "
                         "one transformers requires)"], lines
    for line, name in zip(lines[1:4], ("torch", "transformers", "peft"), strict=True):
        assert line.startswith(f"  {name} {metadata.version(name)} (declared {name}"), line
        assert "OUTSIDE" not in line and "not a tested version" not in line, line  # the suite runs on the pinned set
        declared = re.search(rf'"{name}(>=[^"]+)"', setup).group(1)
        assert sorted(declared.split(",")) == sorted(line.split(f"declared {name}")[1].split(";")[0].split(",")), line
        # The tested versions are the pins of the three environments the suite runs in, no more, no fewer.
        pinned = {pins(f)[name].split("+")[0] for f in ("constraints.txt", "constraints-oldest.txt",
                                                         "constraints-swift.txt")}
        assert set(TESTED_VERSIONS[name]) == pinned and f"tested {', '.join(TESTED_VERSIONS[name])}" in line, line
        # docs/versions.md's table: the declared range, the suite's pin and the oldest pin.
        row = next(r for r in table.splitlines() if r.startswith(f"| {name} |"))
        assert f"`{declared}" in row and pins("constraints.txt")[name].split("+")[0] in row, row
        assert pins("constraints-oldest.txt")[name] in row, row


def test_docs_and_scripts_name_the_torch_their_environment_has():
    """Every 'torch X.Y.Z' in the docs and scripts is a pinned one, and the swift scripts name the swift env's
    (examples/swift_sft.sh once named .venv's 2.13.0 for an environment that has 2.14.1)."""
    venv_torch = pins("constraints.txt")["torch"].split("+")[0]
    swift_torch = pins("constraints-swift.txt")["torch"].split("+")[0]
    assert venv_torch != swift_torch  # else this test could not tell them apart
    swift_scripts = [*(REPO / "examples").glob("swift_*.sh"), REPO / "scripts" / "swift_env.sh"]
    named = []
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "examples").glob("*.sh"),
                 *(REPO / "scripts").glob("*.sh")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for version in re.findall(r"torch (\d+\.\d+\.\d+)", line):
                where = (path.relative_to(REPO), number, line)
                assert version in (venv_torch, swift_torch), where
                if path in swift_scripts and ".venv" not in line:  # the swift env, not .venv
                    assert version == swift_torch, where
                named.append(path.name)
    assert "swift_sft.sh" in named and "README.md" in named and "versions.md" in named, named


def test_byte_figures_of_the_init_bar_and_logs_agree():
    """The init bar once said "read 0 MiB from disk" where the log said 0.3 MiB, and the save log "wrote 0.5 MiB
    of its 0.3 MiB shard" (what it wrote is not part of that shard)."""
    from twinkle_strategy.checkpoint.training import SaveReport
    from twinkle_strategy.init.engine import InitReport, progress_postfix

    read = int(0.3 * 2**20)
    report = InitReport(rank=0, is_source=True, seconds=1.0, bytes_sent=0, bytes_received=0, shard_bytes=read,
                        buffer_bytes=0, buckets=1, collective_calls=1, peak_rss_bytes=0, tensors=1, bytes_read=read)
    assert progress_postfix(read) == "read 0.3 MiB from the checkpoint"
    assert "read 0.3 MiB from the checkpoint in 0.00s" in report.log_line()
    save = SaveReport(path="ck", rank=0, seconds=1.0, bytes_written=int(0.5 * 2**20), bytes_received=0,
                      shard_bytes=read, rss_before_bytes=0, peak_rss_bytes=0).log_line()
    assert "wrote 0.5 MiB (weights, and optimizer state when saved; it keeps a 0.3 MiB model shard)" in save, save


def test_example_runs_as_its_docstring_says_from_an_interpreter_without_torch(tmp_path):
    """``python examples/ep_fsdp_demo.py`` from an interpreter without torch (``-S``: no site-packages): one
    line saying how to create .venv; with a .venv in the checkout, the run moves there and trains with
    memory_efficient_init (2 simulated nodes x 1 rank, 2 steps)."""
    import os
    import shutil

    (tmp_path / "examples").mkdir()
    script = tmp_path / "examples" / "ep_fsdp_demo.py"
    shutil.copy(REPO / "examples" / "ep_fsdp_demo.py", script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-S", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc
    assert proc.stderr.startswith("ep_fsdp_demo.py: torch is not installed for ") and \
        f"create it once with `bash {tmp_path}/scripts/demo.sh`" in proc.stderr, proc.stderr
    venv_python = tmp_path / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # the checkout's .venv: this one's python
    venv_python.chmod(0o755)
    proc = subprocess.run([sys.executable, "-S", str(script), "--steps", "2", "--nnodes", "2", "--nproc-per-node", "1",
                           "--output-dir", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step   2/2  loss " in proc.stdout and "saved the trained model" in proc.stdout, proc.stdout
    assert "memory_efficient_init: node 1 streams " in proc.stderr and " rank 0 (source) kept " in proc.stderr, \
        proc.stderr[-3000:]


def test_expert_load_heatmap_labels_every_expert_and_layer(tmp_path):
    """expert_load.png once labelled only the layers: which expert is overloaded could not be read off it."""
    from twinkle_strategy.train.plots import MAX_LABELLED_ROWS, _pyplot, expert_load_figure, plot_expert_load

    plt = _pyplot()
    layers, experts = 2, 8  # the demo's
    window = [[1.0] * experts for _ in range(layers)]
    window[1][5] = 10.0  # layer 1's expert 5 takes most of its layer's tokens
    counts = [window] * 3
    fig = expert_load_figure(plt, [5, 10, 15], counts)
    ax = fig.axes[0]
    labels = {round(tick): label.get_text() for tick, label in zip(ax.get_yticks(), ax.get_yticklabels(),
                                                                       strict=True)}
    assert labels == {layer * experts + e: (f"layer {layer} expert 0" if e == 0 else f"expert {e}")
                      for layer in range(layers) for e in range(experts)}
    # The brightest row is labelled with the overloaded expert, below its layer's label.
    brightest = int(ax.get_images()[0].get_array()[:, 0].argmax())
    assert (brightest, labels[brightest], labels[brightest - 5]) == (13, "expert 5", "layer 1 expert 0")
    plt.close(fig)
    # A large model (48 layers x 128 experts): every layer still labelled, the experts at a readable spacing.
    fig = expert_load_figure(plt, [1], [[[1.0] * 128] * 48])
    shown = [label.get_text() for label in fig.axes[0].get_yticklabels()]
    assert all(f"layer {layer} expert 0" in shown for layer in range(48)) and len(shown) <= 2 * MAX_LABELLED_ROWS
    plt.close(fig)
    assert plot_expert_load(str(tmp_path), [5, 10, 15], counts) == str(tmp_path / "images" / "expert_load.png")


def _throwaway_checkout(tmp_path):
    """A copy of the scripts with a .venv whose python is this interpreter, except that ``python -m pip`` only
    notes its call in pip-calls.log (an install would go into the real environment); constraints.txt pins what
    this interpreter has installed, so that the copy's .venv is current once stamped."""
    repo = tmp_path / "checkout"
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / "scripts").mkdir()
    for name in ("_env.sh", "_venvs.sh", "venv_current.py"):
        (repo / "scripts" / name).write_text((REPO / "scripts" / name).read_text())
    (repo / "setup.py").write_text((REPO / "setup.py").read_text())
    (repo / "constraints.txt").write_text(
        "".join(f"{name}=={metadata.version(name)}\n" for name in ("torch", "transformers", "peft")))
    python = repo / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then echo "$*" >> "{tmp_path}/pip-calls.log"; '
                      f'exit 0; fi\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (repo / ".venv" / "bin" / "activate").write_text(f'PATH="{repo}/.venv/bin:$PATH"\n')
    return repo


def test_scripts_install_into_dot_venv_only_when_it_is_stale(tmp_path):
    """Issue 31 point 5: every scripts/*.sh run used to reinstall the package. scripts/_env.sh on a throwaway
    checkout (never the real .venv): pip runs for a .venv without the stamp, not again once it is current, and
    again when constraints.txt changes; the decision also catches a version that differs from its pin."""
    repo = _throwaway_checkout(tmp_path)
    log = tmp_path / "pip-calls.log"

    def source_env():
        proc = subprocess.run(["bash", "-c", "source scripts/_env.sh"], cwd=repo, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return calls, proc.stderr

    calls, err = source_env()  # a fresh .venv: no stamp
    assert len(calls) == 2 and "-e .[test]" in calls[1] and "installing the pinned set" in err, (calls, err)
    assert (repo / ".venv" / ".twinkle-env").read_text().strip()
    assert source_env() == ([], "")  # current: no pip, not a line
    with open(repo / "constraints.txt", "a") as f:
        f.write("# a new pin would go here\n")  # the stamp hashes constraints.txt and setup.py
    calls, _ = source_env()
    assert len(calls) == 2, calls
    assert source_env() == ([], "")

    def is_current(constraints):
        return subprocess.run(["bash", "-c", 'source scripts/_venvs.sh && dot_venv_is_current .venv "$0"',
                               constraints], cwd=repo, capture_output=True, timeout=60).returncode == 0

    assert is_current("constraints.txt")
    # A stamp that matches, but an installed version that differs from its pin (say, a pip install by hand).
    stale = repo / "stale.txt"
    stale.write_text(f"peft=={metadata.version('peft')}.post9\n")
    subprocess.run(["bash", "-c", 'source scripts/_venvs.sh && dot_venv_stamp "$0" > .venv/.twinkle-env',
                    str(stale)], cwd=repo, check=True, timeout=60)
    assert not is_current(str(stale))


def _family_counts(text: str) -> list[tuple[int, int | None]]:
    """Every family count ``text`` states: (matching, of how many), None where it gives no total."""
    flat = " ".join(text.replace("*", "").split())
    counts = [(int(a), int(b)) for a, b in re.findall(r"\b(\d+) of (\d+)(?: families)? (?:match|served|run)", flat)]
    counts += [(int(a), None) for a in re.findall(r"\b(\d+) (?:more )?families\b", flat)]
    counts += [(int(a), None) for a in re.findall(r"(?<! of )\b(\d+) match\b", flat)]
    return counts


def test_the_docs_state_only_the_family_counts_docs_models_md_generates():
    """The README once said "column bf16: 25 of 26 match" beside docs/models.md's generated 28 of 30 (and earlier,
    three counts of its own). It and the docs pages point to docs/models.md; any count they state must be one
    docs/models.md has."""
    models = (REPO / "docs" / "models.md").read_text()
    headline = re.search(r"\*\*(\d+) of (\d+) families match\.\*\*", models)
    bf16 = re.search(r"keeps tensors in fp32 under bf16 \((\d+);.*?\*\*(\d+) match\*\*", models)
    assert headline and bf16, "docs/models.md's generated counts moved: update this test"
    generated = {(int(headline[1]), int(headline[2])), (int(bf16[2]), int(bf16[1]))}
    allowed = generated | {(a, None) for a, _ in generated} | {(b, None) for _, b in generated}
    assert (int(headline[1]), int(headline[2])) in _family_counts(models) and set(_family_counts(models)) <= allowed
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        if page.name != "models.md":
            stated = _family_counts(page.read_text())
            assert set(stated) <= allowed, (page.name, stated, generated)
    assert "docs/models.md" in (REPO / "README.md").read_text()
    # The check sees the spellings the README once used.
    assert _family_counts("column bf16: 25 of 26 match; 48 more families; 54 of 57 served") == \
        [(25, 26), (54, 57), (48, None)]


def test_the_shipped_demo_data_is_one_format_that_load_dataset_and_trl_take():
    """examples/data/demo_sft.jsonl is TRL's conversational format only (it once mixed query/response rows, and
    load_dataset + SFTTrainer failed with KeyError 'text'), and it is what the package's demo generates."""
    from datasets import load_dataset

    from twinkle_strategy.sources.demo import demo_dataset_text

    assert (REPO / "examples" / "data" / "demo_sft.jsonl").read_text() == demo_dataset_text()
    dataset = load_dataset("json", data_files=DATASET, split="train")
    assert dataset.column_names == ["messages"] and len(dataset) == 236
    assert all([m["role"] for m in row] == ["user", "assistant"] for row in dataset["messages"])


def test_tiny_demo_from_python_is_built_once_and_is_twinkle_sfts(tmp_path, monkeypatch):
    """``tiny://demo`` resolves in the library as in twinkle-sft (the same checkpoint, byte for byte, as twinkle-sft
    builds from the shipped data), through the public helper, built on the first call and reused afterwards."""
    import twinkle_strategy
    from twinkle_strategy.sources.model_ids import resolve_model_path
    from twinkle_strategy.train.demo_model import prepare_demo_model

    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))
    path = twinkle_strategy.demo_model_path()
    assert path.startswith(str(tmp_path / "cache"))
    built = {f.name: f.stat().st_mtime_ns for f in sorted(Path(path).iterdir())}
    assert resolve_model_path("tiny://demo") == path == twinkle_strategy.demo_model_path()
    assert {f.name: f.stat().st_mtime_ns for f in sorted(Path(path).iterdir())} == built  # not built again
    twinkle_sfts = Path(prepare_demo_model(str(tmp_path / "twinkle-sft"), DATASET))
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (Path(path) / name).read_bytes() == (twinkle_sfts / name).read_bytes(), name
    assert Path(twinkle_strategy.demo_dataset_path()).read_text() == Path(DATASET).read_text()
